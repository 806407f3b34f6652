"""megart import-hf --target-tensor-parallel-size T --target-pipeline-parallel-size P: the
release checkpoint written as that layout's rank files, one pipeline stage at a time. The
reference is the one-file import of the same directory: merged, the files hold exactly its
tensors (tests/test_import_hf.py trains from both)."""

import pytest
import torch

from megart.cli.main import main as megart_main
from megart.training import checkpoint_save, import_hf
from megart.training.shards import read_shards, whole_tensors

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

GPT2 = dict(vocab_size=200, n_positions=32, n_embd=32, n_layer=4, n_head=4)
LLAMA = dict(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf_dir(request, tmp_path_factory):
    """transformers' own randomly initialised GPT-2 (tied) or GQA Llama (untied), with a
    vocabulary that tensor parallelism pads (200 -> 256 or 512 rows)."""
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    if request.param == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.save_pretrained(root)
    return root


def merged(ckpt) -> dict[str, torch.Tensor]:
    """The checkpoint's whole tensors, its vocabulary rows cut to the model's 200."""
    shards = read_shards(ckpt / "iter_0000000")
    cfg = import_hf.GPTConfig(**next(iter(shards.values()))["model_config"])
    whole = whole_tensors(shards, cfg)
    for name in ("chunk.wte.weight", "chunk.output_layer.weight"):
        if name in whole:
            assert not whole[name][200:].any(), f"{name}: padding rows are not zero"
            whole[name] = whole[name][:200]
    return whole


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2), (2, 4), (4, 1)])
def test_the_files_of_a_layout_hold_the_one_file_import_split(hf_dir, tmp_path, tp, pp):
    import_hf.import_checkpoint(hf_dir, tmp_path / "one", seq_length=16)
    files = import_hf.import_checkpoint(hf_dir, tmp_path / "split", seq_length=16, tp=tp, pp=pp)
    assert len(files) == tp * pp and all(f.is_file() for f in files)
    want, got = merged(tmp_path / "one"), merged(tmp_path / "split")
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    shards = read_shards(tmp_path / "split" / "iter_0000000")
    last = [shards[t, pp - 1]["model"][0] for t in range(tp)]
    if "wpe.weight" in last[0]:  # GPT-2 ties: the last stage holds the embedding too
        whole = torch.cat([state["wte.weight"] for state in last])[:200]
        assert torch.equal(whole, want["chunk.wte.weight"])
    for (_, p), state in shards.items():
        for key, tensor in state["model"][0].items():  # a slice, not its whole tensor's bytes
            assert tensor.untyped_storage().nbytes() == tensor.numel() * 4, key
        # Megatron's padding for the layout: 200 rows to a multiple of 128 t, t slices.
        if "wte.weight" in state["model"][0]:
            assert state["model"][0]["wte.weight"].shape[0] == {1: 256, 2: 128, 4: 128}[tp]
        assert state["release"] and state["layer_ids"] == [
            list(range(p * 4 // pp, (p + 1) * 4 // pp))
        ]


def test_the_import_holds_one_stage_at_a_time(hf_dir, tmp_path, monkeypatch):
    """Each stage's tensors are read after the previous stage's files were written, and each
    at most once per stage that holds it: the import never holds more than one stage."""
    events = []
    take = import_hf.lazy_tensors

    def recording_take(path, fmt):
        inner = take(path, fmt)
        return lambda name: events.append(("read", name)) or inner(name)

    write = checkpoint_save.write_file
    monkeypatch.setattr(import_hf, "lazy_tensors", recording_take)
    monkeypatch.setattr(
        checkpoint_save,
        "write_file",
        lambda path, state: events.append(("write", path)) or write(path, state),
    )
    import_hf.import_checkpoint(hf_dir, tmp_path, tp=2, pp=4)
    stage = 0
    stages_read: list[list[str]] = [[]]
    for kind, what in events:
        if kind == "write":
            if stages_read[-1]:  # the first file of a stage after its reads
                stages_read.append([])
        else:
            stages_read[-1].append(what)
    stages_read = [names for names in stages_read if names]
    assert len(stages_read) == 4
    for stage, names in enumerate(stages_read):
        assert len(names) == len(set(names)), f"stage {stage} read a tensor twice"
        layers = {
            int(n.split(".")[2 if n.startswith("model.") else 1])
            for n in names
            if ".layers." in n or n.startswith("h.")
        }
        assert layers == {stage}, (stage, names)


def test_a_failed_import_leaves_an_earlier_one_whole(hf_dir, tmp_path, monkeypatch):
    import_hf.import_checkpoint(hf_dir, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    take = import_hf.lazy_tensors

    def failing_take(path, fmt):
        inner = take(path, fmt)

        def read(name):
            if ".3." in name:  # the last stage's layer: three files are written by then
                raise RuntimeError("disk gone")
            return inner(name)

        return read

    monkeypatch.setattr(import_hf, "lazy_tensors", failing_take)
    with pytest.raises(RuntimeError, match="disk gone"):
        import_hf.import_checkpoint(hf_dir, tmp_path, tp=1, pp=4)
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_a_layout_the_model_cannot_take_is_refused_once_before_any_file(hf_dir, tmp_path, capsys):
    argv = ["import-hf", "--input", str(hf_dir), "--save", str(tmp_path / "c")]
    assert megart_main([*argv, "--target-tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "do not split over tensor-parallel size 3" in err and err.count("\n") == 1
    assert not (tmp_path / "c").exists()
    assert megart_main([*argv, "--target-pipeline-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 rank files: release checkpoint (saved for tp 1 x pp 2; any layout loads it)" in out


def test_convert_from_hf_to_megart_takes_the_target_layout_as_import_hf(hf_dir, tmp_path, capsys):
    layout = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
    args = ["--input", str(hf_dir), "--save", str(tmp_path / "a"), *layout]
    assert megart_main(["import-hf", *args]) == 0
    convert = ["convert-checkpoint", "--from", "hf", "--to", "megart", "--load", str(hf_dir)]
    assert megart_main([*convert, "--save", str(tmp_path / "b"), *layout]) == 0
    a, b = (sorted((tmp_path / d).rglob("*.pt")) for d in "ab")
    assert len(a) == 4 and [f.read_bytes() for f in a] == [f.read_bytes() for f in b]
    capsys.readouterr()
    assert megart_main([*convert, "--save", str(tmp_path / "c"), layout[0], "0"]) == 2
    assert "--target-tensor-parallel-size 0: give 1 or more" in capsys.readouterr().err
