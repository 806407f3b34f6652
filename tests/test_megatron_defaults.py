"""megart train's defaults are Megatron's: every TrainConfig field that Megatron-Core's
TransformerConfig, OptimizerConfig or DistributedDataParallelConfig also has takes the same
default, apart from the exceptions below, each with its reason (a script written for Megatron-LM
that leaves a flag out must train the same model under megart)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from megart.training.config import TrainConfig

# Megatron has no usable default for these (a script must give them): megart's default run's.
REQUIRED_BY_MEGATRON = {"num_layers", "hidden_size", "num_attention_heads", "lr"}
# Megatron-LM's arguments.py overrides the dataclass (it excludes gradient_accumulation_fusion
# from its TransformerConfig flags, on by default, and defaults --min-lr to 0.0), or megart
# differs on purpose without changing the numbers (docs/training.md, Defaults).
DIFFERENT = {
    "gradient_accumulation_fusion": "arguments.py: on unless --no-gradient-accumulation-fusion",
    "min_lr": "arguments.py's default is 0.0 (OptimizerConfig's None means the same)",
    "attention_backend": "an enum there, its name here",
    "overlap_grad_reduce": "megart reduces during backward by default (the same sums)",
    "recompute_method": "Megatron asks for it with full recomputation; megart: uniform",
    "recompute_num_layers": "likewise; megart: 1",
    "cp_comm_type": "arguments.py's default is p2p (TransformerConfig's None means the same)",
    "moe_layer_freq": "the flag's text here (parsed as Megatron's moe_freq_type); None means 1, "
    "every layer MoE (model_flags.moe_fields)",
}


def _megatron_defaults() -> dict[str, object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron-Core warns that apex and TE are absent
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.transformer_config import TransformerConfig
    out = {}
    for cls in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out.setdefault(f.name, f.default)
    return out


def test_every_shared_default_is_megatrons() -> None:
    pytest.importorskip("megatron.core")
    theirs = _megatron_defaults()
    ours = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    shared = sorted(set(ours) & set(theirs) - REQUIRED_BY_MEGATRON - set(DIFFERENT))
    # The comparison must cover the defaults that change a run, not be vacuous.
    assert {"hidden_dropout", "attention_dropout", "adam_beta2", "init_method_std"} <= set(shared)
    differ = {n: (ours[n], theirs[n]) for n in shared if ours[n] != theirs[n]}
    assert not differ, f"megart's default, Megatron-Core's: {differ}"


def test_the_learning_rate_schedule_defaults_are_megatron_lms() -> None:
    # Megatron-LM's arguments.py (not in Megatron-Core): --lr-decay-style linear, --min-lr 0.0,
    # --lr-warmup-iters 0, --lr-warmup-init 0.0.
    config = TrainConfig()
    assert (config.lr_decay_style, config.min_lr, config.warmup_iters, config.lr_warmup_init) == (
        "linear",
        0.0,
        0,
        0.0,
    )
