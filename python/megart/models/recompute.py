"""Activation recomputation (Megatron's --recompute-granularity): keep only a checkpointed
function's inputs in forward and run it again during backward.

torch's non-reentrant checkpoint already replays the default CPU/CUDA generators and autocast.
The tensor-parallel random stream lives in megart's RNGStatesTracker instead, so the replay
also needs the tracker's states as they were when the forward ran: otherwise dropout inside a
tensor-parallel region would draw different masks the second time and the gradients would be
wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.checkpoint import checkpoint

from megart.errors import ConfigError
from megart.tensor_parallel import RNGStatesTracker

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
# Megatron's --recompute-modules under selective recomputation that megart's layers have:
# attention's core (softmax(q k^T) v, torch's checkpoint), the input and pre-MLP norms' outputs
# (dropped and made again, models.dropped_output), the whole MLP of dense layers (checkpointed),
# the whole MoE layer of MoE layers and the shared experts within it (checkpointed: Megatron-
# Core's "moe" and "shared_experts").
MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts")
DEFAULT_MODULES = ("core_attn",)  # Megatron-Core's when none are given
# Megatron-Core's other choices (0.16's and later ones), and why megart has none of them.
OTHER_MODULES = {
    "moe_act": "Megatron-LM recomputes the experts' activation only with --moe-grouped-gemm; "
    "megart does not recompute it alone (--recompute-modules moe recomputes the whole layer)",
    "mla_up_proj": "megart does not recompute multi-latent attention's up-projections alone "
    "(core_attn recomputes its attention core, full whole layers)",
    "gdn_norm_out": "megart has no gated delta net layers",
    "gdp_in_proj": "megart has no gated delta product layers",
    "gdp_qkv": "megart has no gated delta product layers",
    "mhc": "megart has no hyper-connections",
}


def check_recompute(cfg: Any) -> None:
    """Refuses GPTConfig's recomputation fields where they name no granularity, method or
    module megart has."""
    if cfg.recompute_granularity not in (None, "full", "selective"):
        raise ConfigError(
            f"recompute_granularity={cfg.recompute_granularity!r}; use 'full' or "
            "'selective' (or None)"
        )
    if cfg.recompute_method not in ("uniform", "block") or cfg.recompute_num_layers < 1:
        raise ConfigError(
            f"recompute_method={cfg.recompute_method!r}, recompute_num_layers="
            f"{cfg.recompute_num_layers}; use 'uniform' or 'block' and at least 1 layer"
        )
    unknown = [m for m in cfg.recompute_modules if m not in MODULES]
    if unknown:
        raise ConfigError(
            f"recompute_modules={list(cfg.recompute_modules)}: megart recomputes "
            f"{', '.join(MODULES)} (not {', '.join(unknown)})"
        )


def recomputed_modules(cfg: Any, recompute: str | None) -> tuple[str, ...]:
    """What selective recomputation recomputes of a GPTConfig's layers (its recompute_modules;
    Megatron's default the attention core alone); nothing under another ``recompute``."""
    return tuple(cfg.recompute_modules) if recompute == "selective" else ()


def checkpointed(fn: Callable[..., Any], rng: RNGStatesTracker | None, *args: Any) -> Any:
    """``fn(*args)``, recomputed in backward with the same random streams."""
    if rng is None:
        return checkpoint(fn, *args, use_reentrant=False)
    saved: dict[str, Any] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved["states"] = rng.get_states()
        yield

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        now = rng.get_states()
        rng.set_states(saved["states"])
        try:
            yield
        finally:
            rng.set_states(now)

    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (forward(), replay()))


def recomputed_spans(layers: int, method: str, num_layers: int) -> list[tuple[int, int, bool]]:
    """How a chunk of ``layers`` blocks runs under full recomputation: (start, stop, recompute)
    spans. ``uniform``: groups of ``num_layers`` blocks, each group one checkpoint. ``block``:
    the first ``num_layers`` blocks each checkpointed, the rest kept."""
    if method == "uniform":
        return [(i, min(i + num_layers, layers), True) for i in range(0, layers, num_layers)]
    kept = min(num_layers, layers)
    return [(i, i + 1, True) for i in range(kept)] + ([(kept, layers, False)] * (kept < layers))
