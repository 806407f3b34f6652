"""--recompute-modules (Megatron's, under selective recomputation): any set of core_attn,
layernorm and mlp gives exactly the gradients and loss curve of the model that keeps its
activations (fp32, one process, dropout on: the streams replay), tp2 with sequence parallelism
and pp2 follow the one-process curve, and what megart cannot recompute, or the flag where
Megatron-LM would ignore it, is refused by name. What each module saves is checked against the
plan's count in test_plan_memory_llama.py and test_plan_memory.py."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.recompute import MODULES
from megart.selftest.training import one_process_curve
from megart.tensor_parallel import RNGStatesTracker, seed_tensor_parallel
from megart.training.config import TrainConfig

BASE = GPTConfig(
    vocab_size=64,
    seq_length=16,
    hidden_size=32,
    num_layers=3,
    num_attention_heads=4,
    hidden_dropout=0.2,
    attention_dropout=0.2,
)


def _grads(**kw: object) -> tuple[float, dict[str, torch.Tensor]]:
    """One fp32 forward and backward of BASE with ``kw``, its tensor-parallel stream seeded."""
    cfg = dataclasses.replace(BASE, **kw)
    rng = RNGStatesTracker()
    seed_tensor_parallel(rng, 7, 0)
    torch.manual_seed(3)  # the hidden dropout's stream
    model = GPT(cfg, rng=rng)
    tokens = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@functools.cache
def _kept(activation: str, fused: bool) -> tuple[float, dict[str, torch.Tensor]]:
    return _grads(activation=activation, bias=activation == "gelu", fused_layer_norm=fused)


@settings(max_examples=16, deadline=None)
@given(
    modules=st.lists(st.sampled_from(MODULES), max_size=4),
    activation=st.sampled_from(["gelu", "swiglu"]),
    fused=st.booleans(),  # the fused kernel's norm returns the residual sum too
)
def test_any_modules_give_exactly_the_gradients_of_the_model_that_keeps_them(
    modules, activation, fused
):
    loss, grads = _kept(activation, fused)
    recomputed = dict(recompute_granularity="selective", recompute_modules=tuple(modules))
    loss_r, grads_r = _grads(
        activation=activation, bias=activation == "gelu", fused_layer_norm=fused, **recomputed
    )
    assert loss_r == loss
    for name, g in grads.items():
        assert torch.equal(grads_r[name], g), (modules, name)


def test_the_loss_curve_is_exactly_the_one_without_recomputation():
    """megart train's loop on one process (fp32, hidden and attention dropout on)."""
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1)
    plain = one_process_curve(dropout)
    every = one_process_curve(
        dict(dropout, recompute_activations=True, recompute_modules=list(MODULES))
    )
    assert [h["loss"] for h in every] == [h["loss"] for h in plain]
    assert [h["grad_norm"] for h in every] == [h["grad_norm"] for h in plain]


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, {}, timeout=300)[0]


TP2_SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)


@pytest.mark.parametrize(
    "layout,modules",
    [
        # The norms' outputs gathered over the sequence for q/k/v and the MLP, both refilled
        (TP2_SP, ["layernorm"]),
        # the MLP's checkpoint gathering its (dropped) input again
        (TP2_SP, list(MODULES)),
        (dict(pipeline_model_parallel_size=2), ["layernorm", "mlp"]),
    ],
    ids=["tp2-sp-layernorm", "tp2-sp-all", "pp2"],
)
def test_parallel_layouts_follow_the_one_process_curve(layout, modules, one_process):
    kw = dict(layout, recompute_granularity="selective", recompute_modules=modules)
    for h, r in zip(launch(tw.train_kw, 2, kw, timeout=300)[0], one_process, strict=True):
        assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
        assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)


def test_tp2_sp_with_dropout_is_the_run_without_recomputation():
    """Attention dropout on the tensor-parallel stream, hidden dropout on the default one:
    both replay."""
    kw = dict(TP2_SP, hidden_dropout=0.1, attention_dropout=0.1)
    plain = launch(tw.train_kw, 2, kw, timeout=300)[0]
    every = dict(kw, recompute_granularity="selective", recompute_modules=list(MODULES))
    for h, r in zip(launch(tw.train_kw, 2, every, timeout=300)[0], plain, strict=True):
        assert h["loss"] == pytest.approx(r["loss"], **tw.SAME_RUN)


def _parse(*argv: str) -> TrainConfig:
    parser = FlagParser(prog="megart train")
    add_arguments(parser)
    config = config_from_args(parser.parse_args(list(argv)))
    config.gpt_config()
    return config


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--recompute-modules", "mlp"], "--recompute-modules mlp without recomputation"),
        (
            ["--recompute-granularity", "full", "--recompute-modules", "layernorm"],
            "--recompute-modules layernorm with --recompute-granularity full",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "core_attn", "moe_act"],
            "--recompute-modules moe_act (Megatron-LM recomputes the experts' activation only "
            "with --moe-grouped-gemm; megart does not recompute it alone (--recompute-modules "
            "moe recomputes the whole layer))",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
            "--recompute-modules mla_up_proj (megart does not recompute multi-latent "
            "attention's up-projections alone (core_attn recomputes its attention core, full "
            "whole layers))",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "moe", "mla_up_proj", "attn"],
            "--recompute-modules mla_up_proj (megart does not recompute multi-latent "
            "attention's up-projections alone (core_attn recomputes its attention core, full "
            "whole layers)); attn (not a module Megatron-LM recomputes)",
        ),
        # Megatron-LM's parser takes one or more names (nargs "+").
        (
            ["--recompute-activations", "--recompute-modules"],
            "argument --recompute-modules: expected at least one argument",
        ),
    ],
)
def test_what_megart_cannot_recompute_or_would_ignore_is_refused_by_name(argv, said):
    with pytest.raises(ConfigError, match="^" + re.escape(said)):
        _parse(*argv)


def test_megatrons_default_is_the_attention_core_and_recompute_activations_keeps_it():
    for argv in (["--recompute-activations"], ["--recompute-granularity", "selective"]):
        assert _parse(*argv).gpt_config().recompute_modules == ("core_attn",)
    cfg = _parse("--recompute-activations", "--recompute-modules", "mlp", "layernorm", "mlp")
    assert cfg.gpt_config().recompute_modules == ("mlp", "layernorm")  # Megatron's set
    # An empty list (Megatron-Core's TransformerConfig takes one): nothing recomputed.
    none = TrainConfig(recompute_granularity="selective", recompute_modules=[]).gpt_config()
    assert not any(none.recomputes(m) for m in MODULES)
    with pytest.raises(ConfigError, match=r"recompute_modules=\['moe_act'\]: megart recomputes"):
        dataclasses.replace(BASE, recompute_modules=("moe_act",))


def test_megatron_checkpoint_args_record_the_modules_as_megatron_lms_parser():
    from megart.training.megatron_files import training_args

    def args(**kw: object) -> object:
        config = TrainConfig(num_layers=2, **kw)
        return training_args(config, config.gpt_config(), 0, 1)

    unset = args(recompute_activations=True)
    assert unset.recompute_modules is None  # Megatron's argparse default: the flag not given
    assert unset.recompute_granularity == "selective"  # validate_args' resolution of the switch
    assert not hasattr(unset, "recompute_activations")  # which it then deletes
    given = args(recompute_granularity="selective", recompute_modules=["layernorm", "mlp"])
    assert given.recompute_modules == ["layernorm", "mlp"]
