"""Megatron-LM's distributed checkpoint (--ckpt-format torch_dist), weights: what
convert-checkpoint writes, Megatron-Core's GPTModel loads through its own dist_checkpointing on
several tensor- and pipeline-parallel layouts and computes megart's logits; what Megatron-Core
saves on several ranks, megart reads and computes Megatron-Core's logits."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart.cli.main import main
from megart.errors import ConfigError
from megart.launcher import LaunchError, launch
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import from_megatron, to_megatron
from megart.models.vocab import fit_vocab
from megart.training.checkpoint import iteration_dir, read_file, write_release
from megart.training.megatron_checkpoint import read_megatron
from megart.training.megatron_dist import is_dist_checkpoint, layer_names, sharded_keys
from megart.training.megatron_layout import WORD

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist writer needs it

LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=48, bias=False, untie_embeddings_and_output_weights=True,
             num_query_groups=2)  # fmt: skip
CONFIGS = {"gpt2": {}, "llama": LLAMA}


def _cfg(kind: str) -> GPTConfig:
    return GPTConfig(vocab_size=100, seq_length=8, hidden_size=16, num_layers=4,
                     num_attention_heads=4, **CONFIGS[kind])  # fmt: skip


def _tokens(cfg: GPTConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                         generator=torch.Generator().manual_seed(5))  # fmt: skip


def _megart_checkpoint(cfg: GPTConfig, directory) -> dict[str, torch.Tensor]:
    """A megart release checkpoint of a GPT whose every tensor differs from its init."""
    torch.manual_seed(1)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand_like(p) * 0.1)
    weights = {k.removeprefix("chunk."): v for k, v in model.state_dict().items()}
    write_release(directory, cfg, weights, list(range(cfg.num_layers)))
    return weights


def _to_dist(megart_dir, out, *flags: str) -> None:
    """convert-checkpoint of megart's checkpoint to Megatron-LM's torch_dist format."""
    args = ["--from", "megart", "--to", "megatron", "--ckpt-format", "torch_dist", *flags]
    assert main(["convert-checkpoint", *args, "--load", str(megart_dir), "--save", str(out)]) == 0


def _logits(cfg: GPTConfig, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    model = GPT(cfg)
    model.chunk.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model.double()(_tokens(cfg))


@settings(max_examples=20, deadline=None)
@given(layers=st.integers(1, 5), llama=st.booleans(), tied=st.booleans())
def test_sharded_keys_stack_layers_and_invert(layers, llama, tied):
    kw = {**LLAMA, "untie_embeddings_and_output_weights": not tied} if llama else {}
    cfg = GPTConfig(vocab_size=50, seq_length=4, hidden_size=8, num_layers=layers,
                    num_attention_heads=2, **kw)  # fmt: skip
    model = {k: torch.randn_like(v) for k, v in to_megatron(GPT(cfg).state_dict(), cfg).items()}
    stored = sharded_keys(model, cfg)
    for key, value in stored.items():
        assert not key.startswith("decoder.layers.") or value.shape[0] == layers, key
        assert "input_layernorm" not in key and "pre_mlp_layernorm" not in key, key
    qkv = stored["decoder.layers.self_attention.linear_qkv.weight"]
    for n in range(layers):  # dimension 0 is the layer number
        assert torch.equal(qkv[n], model[f"decoder.layers.{n}.self_attention.linear_qkv.weight"])
    norm = stored["decoder.layers.self_attention.linear_qkv.layer_norm_weight"]
    assert torch.equal(norm[-1], model[f"decoder.layers.{layers - 1}.input_layernorm.weight"])
    back = layer_names(stored)
    fused = {k.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
              .replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"): v
             for k, v in model.items()}  # fmt: skip
    assert set(back) == set(fused)
    assert all(torch.equal(back[k], v) for k, v in fused.items())


@pytest.mark.parametrize(
    "kind,tp,pp", [("gpt2", 1, 1), ("gpt2", 2, 2), ("llama", 2, 2), ("llama", 2, 1)]
)
def test_megatron_core_loads_what_megart_writes(tmp_path, kind, tp, pp):
    """Written once (whole tensors, vocabulary padded for --target-tensor-parallel-size), the
    store is read by Megatron-Core's ranks, each its slices (SwiGLU's [gate_r; up_r], q/k/v
    groups, vocabulary rows, its stage's layers), as its loader asks: every key it asks for
    is there, and its pipeline computes megart's logits."""
    import megatron_dist_workers as mdw

    cfg = _cfg(kind)
    weights = _megart_checkpoint(cfg, tmp_path / "megart")
    out = tmp_path / "dist"
    _to_dist(tmp_path / "megart", out, "--target-tensor-parallel-size", str(tp))
    root = iteration_dir(out, 0)
    assert is_dist_checkpoint(root) and (root / ".metadata").is_file()
    want = _logits(cfg, weights)
    results = launch(mdw.load_and_run, tp * pp, str(out), _tokens(cfg), tp, pp, timeout=300)
    last = [r for r in results if r is not None]
    assert len(last) == tp
    for got in last:
        assert (got[..., : cfg.vocab_size] - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 0.1


@pytest.mark.parametrize("kind,tp,pp", [("gpt2", 2, 2), ("llama", 2, 2), ("llama", 1, 1)])
def test_megart_reads_what_megatron_core_saves(tmp_path, kind, tp, pp):
    """Megatron-Core's GPTModel on tp x pp ranks saves its own weights (each rank its slices,
    with its extra states) through dist_checkpointing; convert-checkpoint --from megatron reads
    the store whole and megart's GPT of it computes Megatron-Core's logits, as does
    transformers' model of convert-checkpoint --to hf's files."""
    import megatron_dist_workers as mdw

    cfg = _cfg(kind)
    kw = dict(vocab_size=100, seq_length=8, hidden_size=16, num_layers=4, num_attention_heads=4,
              **CONFIGS[kind])  # fmt: skip
    results = launch(mdw.save_megatron, tp * pp, kw, str(tmp_path / "dist"), tp, pp,
                     _tokens(cfg), timeout=300)  # fmt: skip
    theirs = next(r["logits"] for r in results if r["logits"] is not None)
    read_cfg, model, iteration = read_megatron(tmp_path / "dist")
    assert iteration == 3 and read_cfg.ffn_size == cfg.ffn_size  # Megatron's args name 4h
    assert dataclasses.replace(read_cfg, ffn_hidden_size=cfg.ffn_hidden_size) == cfg
    got = mdw.megart_logits(cfg, model, _tokens(cfg))
    assert (got - theirs[..., : cfg.vocab_size]).abs().max().item() < 1e-5
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                 str(tmp_path / "dist"), "--save", str(tmp_path / "back")]) == 0  # fmt: skip
    state = read_file(iteration_dir(tmp_path / "back", 0) / "mp_rank_00" / "model_optim_rng.pt")
    word = fit_vocab(model["embedding.word_embeddings.weight"], cfg.padded_vocab_size(1))
    assert torch.equal(state["model"][0]["wte.weight"], word)  # as read, not recast
    # On to Hugging Face, in GPT-2's or Llama's format by the architecture: transformers' own
    # model of the files computes Megatron-Core's logits.
    transformers = pytest.importorskip("transformers")
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "hf", "--load",
                 str(tmp_path / "dist"), "--save", str(tmp_path / "hf")]) == 0  # fmt: skip
    auto = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    hf = auto.from_pretrained(tmp_path / "hf").double().eval()
    with torch.no_grad():
        logits = hf(_tokens(cfg)).logits
    assert (logits - theirs[..., : cfg.vocab_size]).abs().max().item() < 1e-5
    # export-hf's options pass through: bf16 in 4KB files, each weight the fp32 one rounded.
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "hf", "--load",
                 str(tmp_path / "dist"), "--save", str(tmp_path / "bf16"), "--dtype",
                 "bfloat16", "--max-shard-size", "4KB"]) == 0  # fmt: skip
    from safetensors.torch import load_file

    fp32 = load_file(str(tmp_path / "hf" / "model.safetensors"))
    files = sorted((tmp_path / "bf16").glob("model-*-of-*.safetensors"))
    bf16 = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert len(files) > 1 and bf16.keys() == fp32.keys()
    assert all(torch.equal(bf16[k], v.bfloat16()) for k, v in fp32.items())


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 1)])
def test_megatron_core_runs_a_transformers_llama_converted_from_hf(tmp_path, tp, pp):
    """convert-checkpoint --from hf --to megatron: transformers' own Llama (grouped-query,
    untied), written as a torch_dist store for tp x pp, is read by Megatron-Core's ranks and
    its pipeline computes transformers' logits."""
    import megatron_dist_workers as mdw

    transformers = pytest.importorskip("transformers")
    cfg = _cfg("llama")
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups,
        intermediate_size=cfg.ffn_size, max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.layernorm_epsilon, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    hf = transformers.LlamaForCausalLM(config).double().eval()
    hf.float().save_pretrained(tmp_path / "hf")
    flags = ["--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp)]
    assert main(["convert-checkpoint", "--from", "hf", "--to", "megatron", "--ckpt-format",
                 "torch_dist", *flags, "--load", str(tmp_path / "hf"),
                 "--save", str(tmp_path / "dist")]) == 0  # fmt: skip
    with torch.no_grad():
        want = hf.double()(_tokens(cfg)).logits
    results = launch(mdw.load_and_run, tp * pp, str(tmp_path / "dist"), _tokens(cfg), tp, pp,
                     timeout=300)  # fmt: skip
    last = [r for r in results if r is not None]
    assert len(last) == tp
    for got in last:
        assert (got[..., : cfg.vocab_size] - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 0.1


def test_round_trip_keeps_every_weight(tmp_path):
    cfg = _cfg("llama")
    weights = _megart_checkpoint(cfg, tmp_path / "megart")
    _to_dist(tmp_path / "megart", tmp_path / "dist")
    assert main(["convert-checkpoint", "--from", "megatron", "--to", "megart", "--load",
                 str(tmp_path / "dist"), "--save", str(tmp_path / "back")]) == 0  # fmt: skip
    state = read_file(iteration_dir(tmp_path / "back", 0) / "mp_rank_00" / "model_optim_rng.pt")
    assert set(state["model"][0]) == set(weights)
    assert all(torch.equal(state["model"][0][k], v) for k, v in weights.items())


def test_hf_options_are_for_hugging_face_directories_written(tmp_path, capsys):
    argv = ["convert-checkpoint", "--from", "megart", "--to", "megatron", "--load", "x",
            "--save", str(tmp_path), "--dtype", "bfloat16", "--max-shard-size", "1GB"]  # fmt: skip
    assert main(argv) == 2
    refused = "--dtype, --max-shard-size set how a Hugging Face directory is written"
    assert f"{refused}: use them with --to hf only" in capsys.readouterr().err


def test_ckpt_format_is_for_megatron_checkpoints_written(tmp_path, capsys):
    _megart_checkpoint(_cfg("gpt2"), tmp_path / "megart")
    assert main(["convert-checkpoint", "--from", "megart", "--to", "hf", "--ckpt-format",
                 "torch_dist", "--load", str(tmp_path / "megart"), "--save",
                 str(tmp_path / "hf")]) != 0  # fmt: skip
    assert "--ckpt-format torch_dist sets the format" in capsys.readouterr().err


def test_a_damaged_store_is_a_clear_error(tmp_path):
    _megart_checkpoint(_cfg("gpt2"), tmp_path / "megart")
    _to_dist(tmp_path / "megart", tmp_path / "dist")
    (iteration_dir(tmp_path / "dist", 0) / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="cannot be read as a torch_dist checkpoint"):
        read_megatron(tmp_path / "dist")
    _to_dist(tmp_path / "megart", tmp_path / "again")
    for data in iteration_dir(tmp_path / "again", 0).glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:100])  # truncated
    with pytest.raises(ConfigError, match="cannot be read as a torch_dist checkpoint"):
        read_megatron(tmp_path / "again")


TINY_MODEL = dict(
    vocab_size=256, seq_length=16, hidden_size=32, num_layers=4, num_attention_heads=4
)  # fmt: skip (train_workers.tiny's model)


TRAIN_LLAMA = {  # LLAMA in megart train's (Megatron's) flags
    "normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True,
    "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
    "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 48,
}  # fmt: skip


@pytest.mark.parametrize(
    "kind,saved,run",
    [("gpt2", (2, 2), (1, 2)), ("llama", (1, 2), (2, 1))],
    ids=["gpt2-tp2pp2-to-pp2", "llama-pp2-to-tp2"],
)
def test_train_loads_megatron_cores_torch_dist_into_another_layout(tmp_path, kind, saved, run):
    """megart train --load of a store Megatron-Core saved on other ranks: each rank reads its
    own slices (SwiGLU's gate and up rows, q/k/v groups, vocabulary rows, row-parallel
    columns, its stage's layers) and holds exactly the store's tensors; a store of weights
    alone loads as --finetune (iteration 0)."""
    import megatron_dist_workers as mdw

    store = tmp_path / "dist"
    model_kw = {**TINY_MODEL, **CONFIGS[kind]}
    cfg = GPTConfig(**model_kw)
    launch(mdw.save_megatron, saved[0] * saved[1], model_kw, str(store), *saved, _tokens(cfg),
           timeout=300)  # fmt: skip
    _, model, _ = read_megatron(store)
    want = {"chunk." + k: v for k, v in from_megatron(model, cfg).items()}
    want["chunk.wte.weight"] = want["chunk.wte.weight"][: cfg.vocab_size]
    kw = {
        "load": str(store),
        "train_iters": 1,
        "tensor_model_parallel_size": run[0],
        "pipeline_model_parallel_size": run[1],
        "ckpt_format": "torch_dist",  # as Megatron's scripts say: accepted, nothing is saved
    }
    kw.update(TRAIN_LLAMA if kind == "llama" else {})
    seen = set()
    for rank in launch(tw.train_holding, run[0] * run[1], kw, timeout=300):
        assert rank["history"][0]["iteration"] == 1  # from iteration 0
        for name, value in rank["loaded"]["weights"].items():
            assert torch.equal(value, want[name].to(value.dtype)), name
            seen.add(name)
    assert seen == set(want)


def test_train_needs_a_flag_for_a_store_with_foreign_optimizer_state(tmp_path):
    """A store whose optimizer state is not the non-distributed optimizer's of this model
    (here one moment of the wrong shape, the rest missing) is refused unless --finetune or
    --no-load-optim, which goes on from the saved iteration."""
    from megart.training.megatron_args import megatron_args
    from megart.training.megatron_dist import write

    cfg = GPTConfig(**TINY_MODEL)
    model = to_megatron(GPT(cfg).state_dict(), cfg)
    model[WORD] = fit_vocab(model[WORD], cfg.padded_vocab_size(1))
    model["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(3)
    write(tmp_path / "dist", 5, megatron_args(cfg, 5), model, cfg)
    (tmp_path / "dist" / "latest_checkpointed_iteration.txt").write_text("5\n")
    with pytest.raises(LaunchError, match="add --finetune .* or --no-load-optim"):
        launch(tw.train_kw, 1, {"load": str(tmp_path / "dist")}, timeout=300)
    kw = {"load": str(tmp_path / "dist"), "train_iters": 7, "no_load_optim": True,
          "no_load_rng": True}  # fmt: skip
    history = launch(tw.train_holding, 1, kw, timeout=300)[0]["history"]
    assert [h["iteration"] for h in history] == [6, 7]


def test_reading_keeps_the_globals_allowed_before(tmp_path):
    """torch's safe_globals context forgets on exit what it was given, even what was allowed
    before it; megart's loads add only what is missing, so that Megatron-Core (which allows
    Namespace at its import) still loads its common.pt after megart read a checkpoint in the
    same process (Megatron-Core's load of a store failed so before)."""
    import argparse

    before = torch.serialization.get_safe_globals()
    _megart_checkpoint(_cfg("gpt2"), tmp_path / "megart")
    _to_dist(tmp_path / "megart", tmp_path / "dist")
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        read_megatron(tmp_path / "dist")
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
