"""Megatron-LM's training flags beyond the GPT-2 defaults (the learning rate's:
test_lr_flags.py). Architecture: each flag reaches GPTConfig through megart train's parser; a
Llama-style model (RMSNorm, rope, SwiGLU, no biases) follows the single-process loss curve under
tp2 and pp2; bad combinations are refused before any work, naming the flags; checkpoints record
the architecture and --load refuses what does not fit, naming the flags; export-hf writes a
Llama-style model in Llama's format (FLOPs: test_flops.py)."""

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import LaunchError, launch
from megart.models import GPTConfig
from megart.training import checkpoint
from megart.training.data import builtin_corpus
from megart.training.export_hf import export_checkpoint
from megart.training.flops import iteration_flops

LLAMA = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    disable_bias_linear=True,
)


def parse(*argv: str):
    """The TrainConfig that `megart train ARGV` runs."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


# -- architecture flags --------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, field, value",
    [
        (["--ffn-hidden-size", "96"], "ffn_hidden_size", 96),
        (["--init-method-std", "0.01"], "init_std", 0.01),
        (["--layernorm-epsilon", "1e-6"], "layernorm_epsilon", 1e-6),
        (["--norm-epsilon", "1e-6"], "layernorm_epsilon", 1e-6),  # Megatron's newer name
        (["--normalization", "RMSNorm"], "normalization", "rmsnorm"),
        (["--position-embedding-type", "rope"], "position_embedding", "rotary"),
        (["--disable-bias-linear"], "bias", False),
        (["--apply-layernorm-1p"], "apply_layernorm_1p", True),
    ],
)
def test_each_architecture_flag_reaches_gpt_config(argv, field, value):
    default = dataclasses.asdict(parse().gpt_config())
    got = dataclasses.asdict(parse(*argv).gpt_config())
    assert got[field] == value != default[field]
    # Without biases there is no bias add to fuse: the fusion goes off too, as in Megatron.
    also = {"bias_gelu_fusion": False} if field == "bias" else {}
    assert {k: v for k, v in got.items() if k != field} == {
        k: also.get(k, v) for k, v in default.items() if k != field
    }


def test_swiglu_takes_megatrons_mlp_size_unless_one_is_given():
    cfg = parse("--swiglu", "--hidden-size", "4096", "--num-attention-heads", "32").gpt_config()
    assert (cfg.activation, cfg.ffn_size) == ("swiglu", int(4 * 4096 * 2 / 3 / 64) * 64)
    assert parse("--swiglu", "--ffn-hidden-size", "100").gpt_config().ffn_size == 100
    assert parse().gpt_config().ffn_hidden_size is None  # 4h, recorded as before


def test_defaults_build_the_gpt2_model_with_megatrons_dropout():
    gpt2 = GPTConfig(
        vocab_size=256, seq_length=128, hidden_size=128, num_layers=4, num_attention_heads=4
    )
    # The MLP's bias add and GeLU fused, Megatron's default: a kernel choice, the same math;
    # Megatron's dropouts (GPTConfig, megart's model API, has none by default).
    megatron = dict(bias_gelu_fusion=True, hidden_dropout=0.1, attention_dropout=0.1)
    assert parse().gpt_config() == dataclasses.replace(gpt2, **megatron)


@pytest.mark.parametrize(
    "argv, fused",
    [
        ((), True),
        (("--no-bias-gelu-fusion",), False),
        (("--swiglu",), False),
        (("--disable-bias-linear",), False),
        (("--swiglu", "--disable-bias-linear"), False),
        (("--swiglu", "--no-bias-gelu-fusion"), False),
        (("--bias-gelu-fusion",), True),
    ],
)
def test_the_default_run_fuses_bias_and_gelu_where_the_mlp_has_them(monkeypatch, argv, fused):
    """As Megatron-LM: bias-GeLU fusion is on by default, off with --no-bias-gelu-fusion, and
    off without a word where there is no bias add and GeLU to fuse (--swiglu,
    --disable-bias-linear). Each layer's MLP calls bias_gelu exactly when it is on."""
    import torch

    import megart.models.mlp as blocks
    from megart.models import GPT

    config = parse(*argv)
    config.check(1)  # no refusal: the user did not ask for the fusion
    cfg = config.gpt_config()
    assert cfg.bias_gelu_fusion is fused
    calls = []

    def counted(x, bias):
        calls.append(x.shape)
        return blocks_bias_gelu(x, bias)

    blocks_bias_gelu = blocks.bias_gelu
    monkeypatch.setattr(blocks, "bias_gelu", counted)
    tokens = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    GPT(cfg)(tokens[:, :-1], tokens[:, 1:]).backward()
    assert len(calls) == (cfg.num_layers if fused else 0)


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (
            ["--fused-layer-norm", "--normalization", "RMSNorm"],
            1,
            "--fused-layer-norm is a LayerNorm kernel: leave it out with --normalization RMSNorm",
        ),
        (["--bias-gelu-fusion", "--swiglu"], 1, "--bias-gelu-fusion fuses .* with --swiglu$"),
        (
            ["--bias-gelu-fusion", "--swiglu", "--disable-bias-linear"],
            1,
            "leave it out with --swiglu and --disable-bias-linear",
        ),
        (
            ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"],
            1,
            "--lr-warmup-fraction 0.1 and --lr-warmup-iters 5 exclude each other",
        ),
        (["--lr-warmup-fraction", "1.5"], 1, "--lr-warmup-fraction 1.5 must be at least 0"),
        (
            ["--ffn-hidden-size", "65", "--tensor-model-parallel-size", "2"],
            2,
            "MLP size 65 \\(--ffn-hidden-size\\) does not split over "
            "--tensor-model-parallel-size 2",
        ),
        (
            ["--position-embedding-type", "rope", "--hidden-size", "36"],
            1,
            "--hidden-size 36 / --num-attention-heads 4 = 9 is odd",
        ),
        (
            ["--swiglu", "--hidden-size", "16"],
            1,
            "MLP size 0 \\(--swiglu's default for --hidden-size 16, .*give --ffn-hidden-size",
        ),
        (["--ffn-hidden-size", "0"], 1, "the MLP size 0 must be positive"),
        (["--init-method-std", "-1"], 1, "--init-method-std -1.0 must be at least 0"),
    ],
)
def test_bad_combinations_are_refused_naming_the_flags(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).check(world)


def test_the_python_api_is_refused_in_megatrons_spellings():
    with pytest.raises(ConfigError, match="--normalization 'rmsnorm'; use one of LayerNorm, RMSN"):
        tw.tiny(normalization="rmsnorm").check(1)
    with pytest.raises(ConfigError, match="--lr-decay-style 'wsd'; use one of constant, linear"):
        tw.tiny(lr_decay_style="wsd").check(1)


def megart(*args):
    return subprocess.run(
        [sys.executable, "-m", "megart", *args], capture_output=True, text=True, timeout=300
    )


def test_megart_train_lists_the_flags_and_refuses_before_any_work():
    text = " ".join(megart("train", "--help").stdout.split())
    for flag in (
        "--lr-decay-style {constant,linear,cosine,inverse-square-root,WSD}",
        "--lr-wsd-decay-style {exponential,linear,cosine,minus_sqrt}",
        "--lr-warmup-fraction LR_WARMUP_FRACTION",
        "--ffn-hidden-size FFN_HIDDEN_SIZE",
        "--init-method-std INIT_METHOD_STD",
        "--layernorm-epsilon LAYERNORM_EPSILON, --norm-epsilon LAYERNORM_EPSILON",
        "--normalization {LayerNorm,RMSNorm}",
        "--position-embedding-type {learned_absolute,rope,yarn}",
        "--swiglu SwiGLU",
        "--disable-bias-linear no biases",
    ):
        assert flag in text
    assert "(default: linear)" in text
    out = megart("train", "--swiglu", "--bias-gelu-fusion")
    assert out.returncode == 2 and "iteration" not in out.stdout
    assert "--bias-gelu-fusion fuses the MLP's bias add and GeLU" in out.stderr
    out = megart("train", "--normalization", "rmsnorm")
    assert out.returncode == 2 and "invalid choice: 'rmsnorm'" in out.stderr


# -- a Llama-style model under every parallelism ---------------------------------------------


def _llama(kw):
    """Trains a Llama-style tiny GPT with a linear decay after a fractional warm-up; returns
    the figures, the model's parameter names (layer numbers cut) and the FLOPs it counts."""
    from megart.training.trainer import Trainer

    config = tw.tiny(**LLAMA, lr_decay_style="linear", lr_warmup_iters=0, lr_warmup_fraction=0.5,
                     train_iters=8)  # fmt: skip
    config = dataclasses.replace(config, **kw)
    trainer = Trainer(config, tokens=builtin_corpus(1 << 16))
    names = {
        n.split(".", 2)[-1] if n.startswith("blocks.") else n
        for c in trainer.chunks
        for n, _ in c.named_parameters()
    }
    return trainer.train(quiet=True), sorted(names), trainer.flops


@pytest.fixture(scope="module")
def llama_reference():
    return launch(_llama, 1, {}, timeout=300)[0]


def test_the_llama_style_model_is_what_the_flags_say(llama_reference):
    history, names, flops = llama_reference
    assert "mlp.gate.weight" in names and "wpe.weight" not in names  # SwiGLU, rope
    assert not [n for n in names if n.endswith("bias")]  # no biases; RMSNorm has none either
    c = tw.tiny(**LLAMA, lr_decay_style="linear", lr_warmup_iters=0, lr_warmup_fraction=0.5,
                train_iters=8)  # fmt: skip
    assert [h["lr"] for h in history] == [c.learning_rate(i) for i in range(8)]
    # Warm-up over 4 of the 8 decay iterations from 0 (Megatron's), then linear to 1e-4.
    warm = [1e-3 * i / 4 for i in range(5)]
    assert [h["lr"] for h in history] == pytest.approx(
        warm + [1e-3 - 0.9e-3 * i / 4 for i in (1, 2, 3)]
    )
    # SwiGLU's MLP of Megatron's size (64 for h 32): three h x 64 matrices in the count.
    assert flops == iteration_flops(8, 16, 4, 32, 256, ffn_hidden=64, swiglu=True)
    # It learns: over batches that differ, the last two losses below the first two.
    assert history[-1]["loss"] + history[-2]["loss"] < history[0]["loss"] + history[1]["loss"]


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, dict(tensor_model_parallel_size=2)),
        (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        (2, dict(pipeline_model_parallel_size=2)),
    ],
    ids=["tp2", "tp2-sequence-parallel", "pp2"],
)
def test_llama_style_follows_the_single_process_loss_curve(nproc, layout, llama_reference):
    reference = llama_reference[0]
    for history, _, _ in launch(_llama, nproc, layout, timeout=300):
        assert len(history) == len(reference) == 8
        for h, r in zip(history, reference, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)


# -- checkpoints ---------------------------------------------------------------------------


def test_checkpoints_record_the_architecture_and_refuse_another(tmp_path):
    arch = dict(LLAMA, init_method_std=0.01, layernorm_epsilon=1e-6)
    launch(tw.train_kw, 1, dict(arch, train_iters=1, save=str(tmp_path)), timeout=300)
    saved = checkpoint.read_file(tmp_path / "iter_0000001" / "mp_rank_00" / checkpoint.FILE)
    got = {k: saved["model_config"][k] for k in ("normalization", "position_embedding")}
    assert got == {"normalization": "rmsnorm", "position_embedding": "rotary"}
    assert saved["model_config"]["activation"] == "swiglu"
    assert saved["model_config"]["bias"] is False
    assert saved["model_config"]["ffn_hidden_size"] == 64
    assert saved["model_config"]["init_std"] == 0.01
    assert saved["model_config"]["layernorm_epsilon"] == 1e-6
    # The same flags resume (a different --init-method-std only changes initial weights).
    resumed = launch(
        tw.train_kw,
        1,
        dict(arch, init_method_std=0.02, train_iters=2, load=str(tmp_path)),
        timeout=300,
    )[0]
    assert [h["iteration"] for h in resumed] == [2]
    # The GPT-2 architecture (every flag left out) is another model.
    message = (
        r"saved with --ffn-hidden-size 64 \(now --ffn-hidden-size 128\), --normalization "
        r"RMSNorm \(now --normalization LayerNorm\), --position-embedding-type rope \(now "
        r"--position-embedding-type learned_absolute\), --swiglu \(now neither --swiglu nor "
        r"--squared-relu\), --disable-bias-linear \(now no --disable-bias-linear\), "
        r"--layernorm-epsilon 1e-06 \(now --layernorm-epsilon 1e-05\), --rotary-base 10000 "
        r"\(halves\) \(now no rope\); "
        r".*cannot be resharded"
    )
    with pytest.raises(LaunchError, match=message):
        launch(tw.train_kw, 1, dict(train_iters=2, load=str(tmp_path)), timeout=300)
    neither = r"\(now neither --swiglu nor --squared-relu\);"
    with pytest.raises(LaunchError, match=r"saved with --swiglu " + neither):
        kw = dict(arch, swiglu=False, ffn_hidden_size=64, train_iters=2, load=str(tmp_path))
        launch(tw.train_kw, 1, kw, timeout=300)
    # export-hf writes this architecture in Llama's format (GPT-2's cannot represent it), with
    # the recorded epsilon; tests/test_hf_llama.py checks the weights and logits.
    out = export_checkpoint(tmp_path, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]
    assert (written["rms_norm_eps"], written["intermediate_size"]) == (1e-6, 64)
    assert not (written["attention_bias"] or written["mlp_bias"])
