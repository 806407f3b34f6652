"""megart train's --quick-geglu, --glu-linear-offset and --activation-func-clamp-value
(training.glu_flags): the flags reach the model, Megatron-LM's args hold them both ways, an
ep2 x tp2 run (sequence parallelism) follows the one-process curve, and what is refused, by
name."""

import argparse

import pytest

import megatron_core_ckpt_workers as mckw
import moe_ep_workers as ew
import train_workers as tw
from megart.cli.train import add_arguments, config_from_args
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPTConfig
from megart.models.config_flags import architecture_flags
from megart.training.glu_flags import glu_fields
from megart.training.megatron_args import config_from_args as from_megatron_args
from megart.training.megatron_args import megatron_args

OSS = ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0"]
OSS_KW = dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.5)


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_flags_reach_the_model():
    for bias in (["--disable-bias-linear"], ["--no-bias-gelu-fusion"]):
        cfg = parse(*OSS, *bias).gpt_config()
        assert (cfg.activation, cfg.glu_linear_offset) == ("quick_geglu", 1.0)
        assert cfg.activation_func_clamp_value == 7.0 and not cfg.bias_gelu_fusion
        assert cfg.ffn_size == 4 * cfg.hidden_size  # Megatron's default: 8h/3 is --swiglu's


def test_megatron_args_hold_them_both_ways():
    cfg = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                    num_attention_heads=4, ffn_hidden_size=128, activation="quick_geglu",
                    glu_linear_offset=1.0,
                    activation_func_clamp_value=7.0)  # fmt: skip
    args = vars(megatron_args(cfg, 1, 1, 1))
    assert (args["quick_geglu"], args["swiglu"], args["glu_linear_offset"]) == (True, False, 1.0)
    assert from_megatron_args(args) == cfg
    plain = {k: v for k, v in args.items() if k not in ("glu_linear_offset", "quick_geglu")}
    old = from_megatron_args({**plain, "activation_func_clamp_value": None})
    assert (old.activation, old.glu_linear_offset) == ("gelu", 0.0)  # older args: none


def test_the_fused_path_of_megatrons_run_is_refused():
    """Megatron-LM's experts clamp before the bias under its default bias fusion."""
    a = dict(quick_geglu=True, activation_func_clamp_value=7.0, add_bias_linear=True)
    with pytest.raises(ConfigError, match="give --no-bias-gelu-fusion"):
        glu_fields(dict(a, bias_gelu_fusion=True))
    assert glu_fields(dict(a, bias_gelu_fusion=False))["activation_func_clamp_value"] == 7.0


@pytest.mark.parametrize(
    "argv, says",
    [
        (OSS, "--quick-geglu with biases: .* give --no-bias-gelu-fusion"),
        (["--quick-geglu", "--swiglu", "--disable-bias-linear"], "two MLP activations"),
        (["--glu-linear-offset", "1"], "--glu-linear-offset set the gated MLP of --quick-geglu"),
        (["--swiglu", "--activation-func-clamp-value", "7"], "give --quick-geglu or leave it"),
        (["--quick-geglu", "--disable-bias-linear", "--bias-gelu-fusion"], "--quick-geglu"),
    ],
)
def test_what_megart_cannot_take_is_refused_by_name(argv, says):
    with pytest.raises(ConfigError, match=says):
        parse(*argv).gpt_config()


def test_ep2_tp2_follows_the_one_process_curve():
    """gpt-oss's MLP (offset and clamp) in the experts, split over expert and
    tensor parallelism with sequence parallelism: the one process's losses and gradient norms."""
    one = launch(tw.train_kw, 1, dict(ew.TRAIN, **OSS_KW), timeout=300)[0]
    layout = dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                  sequence_parallel=True)  # fmt: skip
    run = launch(tw.train_kw, 4, dict(ew.TRAIN, **OSS_KW, **layout), timeout=300)[0]
    ew.assert_on_curve(one, run)
    plain = launch(tw.train_kw, 1, {**ew.TRAIN, **OSS_KW, "glu_linear_offset": 0.0}, timeout=300)
    assert abs(plain[0][-1]["loss"] - one[-1]["loss"]) > 1e-4  # the offset changes the run


def test_upcycling_is_refused_by_name():
    """Megatron-Core's upcycling refuses quick_gelu (its activation names)."""
    from megart.training.upcycling_checks import check_upcycling

    config = parse("--quick-geglu", "--disable-bias-linear", "--num-experts", "4",
                   "--moe-use-upcycling", "--save", "/tmp/s", "--load", "/tmp/l")  # fmt: skip
    with pytest.raises(ConfigError, match="--moe-use-upcycling with --quick-geglu"):
        check_upcycling(config)


def test_a_resume_names_another_offset_or_clamp():
    """architecture_flags (what a resume compares) tells the offset and the clamp apart."""
    one = parse(*OSS, "--disable-bias-linear").gpt_config()
    other = parse("--quick-geglu", "--glu-linear-offset", "0.5", "--disable-bias-linear")
    flags = architecture_flags(other.gpt_config())["activation"]
    assert flags == "--quick-geglu --glu-linear-offset 0.5"
    assert architecture_flags(one)["activation"] == (
        "--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7"
    )


def test_megatron_core_loads_its_torch_format_checkpoint(tmp_path):
    """A tp2 run's checkpoint (biases, --no-bias-gelu-fusion), converted to Megatron-LM's legacy
    files: Megatron-Core's GPTModel built from their args loads them strictly and computes the
    same logits; converted back, the weights and config are the original."""
    ckpt = tmp_path / "ckpt"
    kw = dict(OSS_KW, bias_gelu_fusion=False, num_layers=2, train_iters=1, save=str(ckpt),
              ffn_hidden_size=96,
              tensor_model_parallel_size=2)  # fmt: skip
    launch(tw.train_kw, 2, kw, timeout=300)
    r = launch(mckw.legacy_checkpoint_roundtrip, 1, str(ckpt), str(tmp_path), timeout=300)[0]
    assert r["logits"] < 1e-5 and r["iteration"] == 1
    assert r["same_weights"] and r["same_config"]
