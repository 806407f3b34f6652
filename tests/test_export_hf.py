"""Offline export of training checkpoints to Hugging Face GPT-2 (megart export-hf): tp2 x pp2
and interleaved pp2 checkpoints, merged in this process, hold exactly the weights the trained
ranks gathered over their process groups, match the same seed trained in one process and
exported live by GPT.save_hf_gpt2 (to the tolerance layouts agree to), and give transformers'
GPT-2 the logits of megart's GPT; bad input is refused saying what to change."""

import json
import shutil

import pytest
import torch

import train_workers as tw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.training.export_hf import export_checkpoint

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

ITERS = dict(train_iters=2)
LAYOUTS = {
    "tp2-pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "pp2-interleaved": (
        2,
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),
}
FILE = "model_optim_rng.pt"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """(checkpoint dir, the live model's GPT.save_hf_gpt2 dir) of a one-process training."""
    root = tmp_path_factory.mktemp("one")
    kw = dict(save=str(root / "ckpt"), **ITERS)
    launch(tw.weights_after_training, 1, kw, str(root / "live"), timeout=300)
    return root / "ckpt", root / "live"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Trains a layout of LAYOUTS once per module: (checkpoint dir, the weights its ranks hold
    after training, gathered over tensor parallelism and merged over the ranks)."""
    done = {}

    def get(name):
        if name not in done:
            nproc, layout = LAYOUTS[name]
            ckpt = tmp_path_factory.mktemp(name) / "ckpt"
            per_rank = launch(
                tw.weights_after_training,
                nproc,
                dict(save=str(ckpt), **ITERS, **layout),
                timeout=300,
            )
            weights = {}
            for rank in per_rank:
                for key, value in rank.items():
                    # The first and last stage each hold the tied embedding: they stay equal.
                    assert key not in weights or torch.equal(weights[key], value), key
                    weights[key] = value
            done[name] = ckpt, weights
        return done[name]

    return get


def tensors(hf_dir):
    return safetensors.load_file(str(hf_dir / "model.safetensors"))


def logits(hf_dir):
    """(transformers' logits, megart's GPT's logits) from one GPT-2 directory, on fixed tokens."""
    config = json.loads((hf_dir / "config.json").read_text())
    x = torch.randint(
        0,
        config["vocab_size"],
        (2, config["n_positions"]),
        generator=torch.Generator().manual_seed(3),
    )
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ours = GPT.from_hf_gpt2(str(hf_dir)).eval()
    with torch.no_grad():
        return hf(x).logits, ours(x)


def small(**kw):
    return GPTConfig(
        vocab_size=64, seq_length=8, hidden_size=16, num_layers=2, num_attention_heads=2, **kw
    )


rewrite = tw.rewrite_checkpoint_file


def test_one_process_export_is_the_live_export_exactly(one_process, tmp_path):
    ckpt, live = one_process
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert out == tmp_path / "hf"
    expected = tensors(live)
    got = tensors(out)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (live / "config.json").read_text()
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_checkpoint_exports_the_model_it_trained(layout, trained, one_process, tmp_path):
    ckpt, weights = trained(layout)
    out = export_checkpoint(ckpt, tmp_path / "hf")
    # Exactly what the ranks gathered over their groups, read back by megart's importer.
    back = dict(GPT.from_hf_gpt2(str(out)).named_parameters())
    assert back.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(back[name].detach()[: value.shape[0]], value), name
    # The same seed trained in one process and exported live, to the layouts' tolerance.
    _, live = one_process
    expected = tensors(live)
    got = tensors(out)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (live / "config.json").read_text()
    )
    hf, ours = logits(out)
    torch.testing.assert_close(hf, ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf, logits(live)[1], rtol=1e-4, atol=1e-4)


def test_checkpoints_from_before_the_model_config_was_saved_export_the_same(trained, tmp_path):
    ckpt, _ = trained("pp2-interleaved")
    expected = tensors(export_checkpoint(ckpt, tmp_path / "new"))
    old = shutil.copytree(ckpt, tmp_path / "old")
    for path in old.glob(f"iter_*/mp_rank_*/{FILE}"):
        rewrite(path, lambda s: [s.pop("model_config"), s.pop("layer_ids")])
    got = tensors(export_checkpoint(old, tmp_path / "hf"))
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_missing_checkpoints_and_files_are_named(trained, tmp_path):
    with pytest.raises(ConfigError, match="no latest_checkpointed_iteration.txt there"):
        export_checkpoint(tmp_path, tmp_path / "hf")
    ckpt, _ = trained("tp2-pp2")
    with pytest.raises(ConfigError, match=r"no checkpoint of iteration 7 \(it holds iter_0000002"):
        export_checkpoint(ckpt, tmp_path / "hf", iteration=7)
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    (copy / "iter_0000002" / "mp_rank_01_001" / FILE).unlink()
    with pytest.raises(ConfigError, match=r"1 of its 4 files are missing: .*mp_rank_01_001/"):
        export_checkpoint(copy, tmp_path / "hf")
    shutil.copy(
        ckpt / "iter_0000002" / "mp_rank_01_001" / FILE, copy / "iter_0000002" / "mp_rank_01_001"
    )
    (copy / "iter_0000002" / "mp_rank_01_000" / FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="mp_rank_01_000/model_optim_rng.pt is damaged"):
        export_checkpoint(copy, tmp_path / "hf", iteration=2)  # its checksum says so first
    (copy / "iter_0000002" / "mp_rank_01_000" / (FILE + ".sha256")).unlink()  # an older save
    with pytest.raises(ConfigError, match="mp_rank_01_000/model_optim_rng.pt cannot be read"):
        export_checkpoint(copy, tmp_path / "hf", iteration=2)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "option, value, gpt2, flag",
    [
        ("normalization", "rmsnorm", "'layernorm'", "--normalization RMSNorm"),
        ("position_embedding", "rotary", "'learned'", "--position-embedding-type rope"),
        ("activation", "swiglu", "'gelu'", "--swiglu"),
        ("bias", False, "True", "--disable-bias-linear"),
        (
            "untie_embeddings_and_output_weights",
            True,
            "False",
            "--untie-embeddings-and-output-weights",
        ),
    ],
)
def test_models_gpt2_cannot_represent_are_refused_naming_the_option(
    option, value, gpt2, flag, one_process, tmp_path
):
    ckpt = shutil.copytree(one_process[0], tmp_path / "ckpt")
    # As a run of that model would record it: megart train fuses bias and GeLU by default,
    # and not in a SwiGLU MLP or without biases.
    rewrite(
        ckpt / "iter_0000002" / "mp_rank_00" / FILE,
        lambda s: s["model_config"].update({option: value, "bias_gelu_fusion": False}),
    )
    message = f"cannot represent {flag} \\({option}={value!r}; GPT-2 has {gpt2}\\)"
    with pytest.raises(ConfigError, match=message):
        export_checkpoint(ckpt, tmp_path / "hf")
    # The live export refuses it the same way: one check serves both.
    with pytest.raises(ConfigError, match=message):
        GPT(small(**{option: value})).save_hf_gpt2(str(tmp_path / "live"))


def test_megart_export_hf_command(one_process, tmp_path, capsys):
    ckpt, live = one_process
    out = tmp_path / "hf"
    assert megart_main(["export-hf", "--load", str(ckpt), "--output", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}: config.json and model.safetensors (GPT-2)\n"
    assert tensors(out).keys() == tensors(live).keys()
    assert megart_main(["export-hf", "--load", str(tmp_path / "nothing"), "--output", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megart export-hf: error: --load ") and err.count("\n") == 1


def test_an_mlp_size_other_than_4h_is_written_as_n_inner(tmp_path):
    GPT(small(ffn_hidden_size=24)).save_hf_gpt2(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["n_inner"] == 24
    hf, ours = logits(tmp_path)
    torch.testing.assert_close(hf, ours, rtol=1e-5, atol=1e-5)


def test_a_1p_model_exports_its_scale_and_imports_back_zero_centred(tmp_path):
    """--apply-layernorm-1p: GPT-2's LayerNorm holds the scale itself, 1 + the zero-centred
    weight, and transformers computes the 1p model's logits; import-hf --apply-layernorm-1p
    stores the weights zero-centred again, the same network."""
    model = GPT(small(apply_layernorm_1p=True)).eval()
    norms = ("ln_1.weight", "ln_2.weight", "ln_f.weight")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(norms):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_hf_gpt2(str(tmp_path / "hf"))
    written = tensors(tmp_path / "hf")
    for name, p in model.named_parameters():
        if name.endswith(norms):
            gpt2_name = "transformer." + name.removeprefix("chunk.").replace("blocks.", "h.")
            assert torch.equal(written[gpt2_name], p.detach() + 1), name
    x = torch.randint(0, 64, (2, 8), generator=g)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(hf(x).logits, expected, rtol=1e-5, atol=1e-5)
    ckpt = tmp_path / "ckpt"
    argv = ["import-hf", "--input", str(tmp_path / "hf"), "--save", str(ckpt)]
    assert megart_main([*argv, "--apply-layernorm-1p"]) == 0
    state = torch.load(ckpt / "iter_0000000" / "mp_rank_00" / FILE, weights_only=False)
    assert state["model_config"]["apply_layernorm_1p"]
    back = GPT(small(apply_layernorm_1p=True)).eval()
    back.chunk.load_state_dict(state["model"][0])
    for name, p in model.named_parameters():
        torch.testing.assert_close(back.get_parameter(name), p, rtol=0, atol=1e-7, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(back(x), expected, rtol=1e-5, atol=1e-5)


def shard_files(out):
    return sorted(out.glob("model-*-of-*.safetensors"))


def test_a_model_past_max_shard_size_is_written_in_numbered_files_with_an_index(
    one_process, tmp_path, capsys, monkeypatch
):
    """save_pretrained's sharded layout: each file at most --max-shard-size of tensors (or one
    larger tensor alone), an index naming each tensor's file, read by transformers and megart;
    each whole tensor is merged from the checkpoint once, when it is written."""
    import megart.training.export_hf as export_hf

    ckpt, live = one_process
    asked = []
    merge = export_hf.whole_tensors
    monkeypatch.setattr(
        export_hf,
        "whole_tensors",
        lambda *a, wanted: asked.append(wanted) or merge(*a, wanted=wanted),
    )
    out = tmp_path / "sharded"
    argv = ["export-hf", "--load", str(ckpt), "--output", str(out), "--max-shard-size", "20KB"]
    assert megart_main(argv) == 0
    files = shard_files(out)
    assert len(files) > 2 and not (out / "model.safetensors").exists()
    assert capsys.readouterr().out == (
        f"{out}: config.json and model.safetensors.index.json and {len(files)} weight files "
        "(GPT-2)\n"
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected = tensors(live)
    got = {}
    for f in files:
        held = safetensors.load_file(str(f))
        assert f.name == f"model-{files.index(f) + 1:05d}-of-{len(files):05d}.safetensors"
        assert all(index["weight_map"][name] == f.name for name in held)
        nbytes = sum(t.numel() * t.element_size() for t in held.values())
        assert nbytes <= 20_000 or len(held) == 1, (f.name, nbytes)
        got.update(held)
    assert got.keys() == expected.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in got.values())
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert sorted(len(w) for w in asked) == [1] * len(asked)  # one tensor merged at a time
    assert len(asked) == len({name for w in asked for name in w})  # and each once
    hf, ours = logits(out)
    torch.testing.assert_close(hf, ours, rtol=1e-5, atol=1e-5)
    # Written again as one file, the directory keeps no stale shard or index.
    export_checkpoint(ckpt, out)
    assert not shard_files(out) and not (out / "model.safetensors.index.json").exists()
    assert tensors(out).keys() == expected.keys()


def test_export_in_bfloat16_rounds_each_weight_and_says_so(one_process, tmp_path, capsys):
    ckpt, live = one_process
    out = tmp_path / "bf16"
    assert megart_main(["export-hf", "--load", str(ckpt), "--output", str(out),
                        "--dtype", "bfloat16"]) == 0  # fmt: skip
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    expected = tensors(live)
    got = tensors(out)
    for name, value in expected.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], value.bfloat16()), name
    with pytest.raises(ConfigError, match="--dtype int8: use one of float32, bfloat16"):
        GPT(small()).save_hf(str(tmp_path / "int8"), dtype="int8")
    for size in ("0", "5XB", "GB"):
        argv = ["export-hf", "--load", str(ckpt), "--output", str(out), "--max-shard-size", size]
        assert megart_main(argv) == 2
        assert "give a positive size such as 5GB" in capsys.readouterr().err


def small_tokenizer(directory, byte_level: bool = False):
    """A Hugging Face tokenizer saved in ``directory``: BPE over a few words (a dozen tokens),
    or over all 256 bytes (more than tiny()'s 256-token vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel() if byte_level else pre_tokenizers.Whitespace()
    special = ["<unk>", "<s>", "</s>"]
    bpe.train_from_iterator(["hello world", "held a word"] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [],
    ))  # fmt: skip
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(directory)
    return fast


def test_export_with_the_tokenizer_gives_a_directory_that_generates(one_process, tmp_path, capsys):
    ckpt, _ = one_process
    tokenizer = small_tokenizer(tmp_path / "tok")
    out = tmp_path / "hf"
    argv = ["export-hf", "--load", str(ckpt), "--output", str(out)]
    assert megart_main([*argv, "--tokenizer-model", str(tmp_path / "tok")]) == 0
    assert capsys.readouterr().out.endswith(f"(GPT-2); the tokenizer of {tmp_path / 'tok'}\n")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # <s>, </s>
    back = transformers.AutoTokenizer.from_pretrained(out)
    assert back("hello world held")["input_ids"] == tokenizer("hello world held")["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = back("hello world", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 3)
    # A tokenizer with more tokens than the model's vocabulary is refused before any weight.
    small_tokenizer(tmp_path / "bytes", byte_level=True)
    assert megart_main([*argv[:-1], str(tmp_path / "x"), "--tokenizer-model",
                        str(tmp_path / "bytes")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "tokens and the model's vocabulary 256: give the tokenizer the model" in err
    assert not (tmp_path / "x").exists()


def test_an_export_without_a_tokenizer_names_no_token_outside_its_vocabulary(one_process, tmp_path):
    # GPT2Config's default bos/eos is 50256, GPT-2's <|endoftext|>: no token of a 256-token
    # model, which transformers warns of and generation would wait for.
    ckpt, _ = one_process
    out = export_checkpoint(ckpt, tmp_path / "hf", recorded_tokenizer=False)
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.vocab_size == 256
    assert (config.bos_token_id, config.eos_token_id) == (None, None)


def test_an_export_that_fails_leaves_the_directory_as_it_was(one_process, tmp_path, monkeypatch):
    import megart.training.export_hf as export_hf

    ckpt, live = one_process
    out = export_checkpoint(ckpt, tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    merge, calls = export_hf.whole_tensors, []

    def failing(*args, wanted):
        calls.append(wanted)
        if len(calls) == 20:  # after several 20KB files were written
            raise ConfigError("no file holds it")
        return merge(*args, wanted=wanted)

    monkeypatch.setattr(export_hf, "whole_tensors", failing)
    with pytest.raises(ConfigError, match="no file holds it"):
        export_checkpoint(ckpt, out, max_shard_size="20KB")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
