"""Megatron-LM's --squared-relu: the MLP's activation relu(x)^2 (Megatron-Core's squared_relu,
Nemotron's relu2). Against Megatron-Core's GPTModel in float64 (test_megatron_core's
gpt2-squared-relu and nemotron-style rows); here: the flag reaches the model and is refused
with what cannot go with it, the run follows the one-process curve under tensor and pipeline
parallelism, and a checkpoint in Megatron-LM's format records it in its args, which
Megatron-Core's GPTModel loads strictly and computes megart's logits from."""

import argparse
import dataclasses

import pytest

import megatron_core_ckpt_workers as mckw
import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models.config_flags import architecture_flags
from megart.training.megatron_args import config_from_args as model_from_args
from megart.training.megatron_args import megatron_args
from train_workers import SAME_RUN

# Nemotron's mix: squared ReLU, zero-centred LayerNorm, half of each head turning, no biases.
NEMOTRON = dict(squared_relu=True, apply_layernorm_1p=True, disable_bias_linear=True,
                position_embedding_type="rope", rotary_percent=0.5, ffn_hidden_size=96,
                untie_embeddings_and_output_weights=True)  # fmt: skip


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_flag_reaches_the_model_and_megatrons_args_both_ways():
    cfg = parse("--squared-relu", "--ffn-hidden-size", "96").gpt_config()
    assert (cfg.activation, cfg.ffn_size, cfg.bias_gelu_fusion) == ("squared_relu", 96, False)
    args = megatron_args(cfg, iteration=0)
    assert (args.squared_relu, args.swiglu) == (True, False)
    read = model_from_args(vars(args))  # model args alone: dropout is the training args'
    assert dataclasses.replace(read, hidden_dropout=0.1, attention_dropout=0.1) == cfg
    assert architecture_flags(cfg)["activation"] == "--squared-relu"
    gelu = parse().gpt_config()
    assert architecture_flags(gelu)["activation"] == "neither --swiglu nor --squared-relu"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--squared-relu", "--swiglu"], "--swiglu and --squared-relu are two MLP activations"),
        (["--squared-relu", "--bias-gelu-fusion"], "leave it out with --squared-relu"),
    ],
)
def test_what_cannot_go_with_it_is_refused_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).check(1)


@pytest.fixture(scope="module")
def curves():
    kw = dict(NEMOTRON, train_iters=4, hidden_dropout=0.0, attention_dropout=0.0)
    one = launch(tw.train_kw, 1, kw, timeout=300)[0]
    tp2 = launch(tw.train_kw, 2, dict(kw, tensor_model_parallel_size=2), timeout=300)[0]
    pp2 = launch(tw.train_kw, 2, dict(kw, pipeline_model_parallel_size=2), timeout=300)[-1]
    gelu = launch(tw.train_kw, 1, dict(kw, squared_relu=False), timeout=300)[0]
    return one, tp2, pp2, gelu


def test_tensor_and_pipeline_parallel_runs_follow_the_one_process_curve(curves):
    one, tp2, pp2, gelu = curves
    want = [h["loss"] for h in one]
    assert [h["loss"] for h in tp2] == pytest.approx(want, **SAME_RUN)
    assert [h["loss"] for h in pp2] == pytest.approx(want, **SAME_RUN)
    # The activation is in the curve: GeLU's run is another one.
    assert [h["loss"] for h in gelu] != pytest.approx(want, rel=1e-3)


def test_megatron_core_loads_its_torch_format_checkpoint(tmp_path):
    """A tp2 run's checkpoint, converted to Megatron-LM's legacy files: their args say
    squared_relu, and Megatron-Core's GPTModel built with its squared_relu loads them strictly
    and computes the same logits; converted back, the weights and config are the original."""
    ckpt = tmp_path / "ckpt"
    launch(tw.train_kw, 2, dict(NEMOTRON, num_layers=2, train_iters=1, save=str(ckpt),
                                tensor_model_parallel_size=2), timeout=300)  # fmt: skip
    r = launch(mckw.legacy_checkpoint_roundtrip, 1, str(ckpt), str(tmp_path), timeout=300)[0]
    assert r["logits"] < 1e-5 and r["iteration"] == 1
    assert r["same_weights"] and r["same_config"]
