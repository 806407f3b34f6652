"""Search the layouts a user left open and recommend the fastest that fits.

Every combination of the open flags that megart train accepts (candidates) is estimated quickly
(the theoretical bubble and in-flight counts; zero-bubble schedules are simulated even then,
their bubble having no closed form for unequal F, I and W times); the fastest few are then
estimated again with the schedule simulator, which decides the ranking (shortlist). The
schedules tried on p > 1 stages: 1F1B, each interleaving that divides the layers, and for
megart's runtime zb-h1 and zb-v (fixed.schedules).

Context parallelism left out is searched (megart's runtime only; which sizes: candidates).
Layouts with C = 1 are searched exactly as when --context-parallel-size 1 is given, so the
recommendation is never slower than that one; those with C > 1 then enter where they can:
those whose work alone (estimate.work_bound, which no schedule shortens) already takes longer
than the slowest of the table's fitting layouts are not estimated, and the fastest few are
simulated beside the others.
"""

from __future__ import annotations

import math

from megart.errors import ConfigError
from megart.parallel.checks import check_model_fits
from megart.parallel.layout import make_layout
from megart.plan.block_spans import block_candidates, searches_spans
from megart.plan.candidates import candidates
from megart.plan.estimate import Estimate, estimate
from megart.plan.fixed import Fixed
from megart.plan.hardware import GIB, GPUProfile
from megart.plan.layout import ZERO_BUBBLE, Layout, layout_config
from megart.plan.shortlist import could_enter, rank, simulated, time_to_beat, why_slower
from megart.training.config import TrainConfig

# Importable from here as before the split (megart.plan, megart.cli.plan, the tests). _quick
# calls block_candidates through this module: tests/test_plan_block_search.py replaces it here.
__all__ = ["Fixed", "NoFit", "candidates", "search", "why_slower"]


def search(
    base: TrainConfig,
    world: int,
    gpu: GPUProfile,
    fixed: Fixed = Fixed(),
    keep: int = 12,
    **model: object,
) -> list[Estimate]:
    """Estimates of the layouts within ``fixed``, fastest fitting first (then those that do not
    fit, least missing memory first); ``model``: estimate()'s runtime options. Raises megart
    train's ConfigError when the fixed flags cannot run at all, NoFit when nothing fits."""
    megart = model.get("runtime", "megart") == "megart"
    if fixed.schedule in ZERO_BUBBLE and not megart:
        raise ConfigError(
            f"--pipeline-schedule {fixed.schedule}: Megatron-LM has no zero-bubble schedule; "
            "use 1f1b or interleaved with --runtime megatron"
        )
    layouts = candidates(base, world, gpu, fixed, megart)
    # Searched context parallelism comes second: the layouts without it are searched as when
    # --context-parallel-size 1 is given, then those with it that could enter the table.
    split = [x for x in layouts if x.cp > 1 and fixed.cp is None]
    plain = [x for x in layouts if x.cp == 1 or fixed.cp is not None]
    short = max(keep, 24)
    blocks = short if fixed.recompute is False and searches_spans(base, fixed.spans) else 0
    quick, first_error = _quick(base, plain, gpu, model, blocks)
    best = simulated(base, quick, gpu, short, model)
    if split:
        limit = time_to_beat(best, keep)
        entering = could_enter(base, split, gpu, limit, model)
        more, error = _quick(base, entering, gpu, model, blocks, limit)
        first_error = first_error or error
        quick += more
        best += simulated(base, more, gpu, short, model)
    if not quick:
        if first_error is not None:
            raise first_error
        _explain(base, world, fixed, gpu.gpus_per_node if megart else None)
        raise ConfigError(
            f"no layout of {world} GPUs runs this model with global batch "
            f"{base.global_batch_size}: check that the batch splits over data parallelism"
        )
    best.sort(key=rank)
    if not best[0].fits:
        short = best[0].missing_bytes / GIB
        raise NoFit(
            f"no layout fits in {gpu.name}'s memory: the smallest ({best[0].layout.short()}) "
            f"needs {best[0].memory['total'] / GIB:.1f} GiB per GPU, {short:.1f} GiB more than the "
            f"{gpu.usable_bytes / GIB:.1f} GiB usable; use more GPUs, a larger tensor- or "
            "pipeline-parallel size, --recompute-granularity full or "
            "--use-distributed-optimizer",
            best,
        )
    return best[:keep]


def _explain(base: TrainConfig, world: int, fixed: Fixed, gpus_per_node: int | None) -> None:
    """Raises the error megart train gives for the fixed flags (no candidate was left): its
    own checks first, then the layout module's (on nodes of ``gpus_per_node``), which list
    what would fit."""
    tp, pp, chunks, cp = fixed.tp or 1, fixed.pp or 1, fixed.chunks or 1, fixed.cp or 1
    kind = fixed.schedule if fixed.schedule in ZERO_BUBBLE else None
    chunks = 2 if kind == "zb-v" else chunks
    rec = None if fixed.recompute is False else fixed.recompute
    plain = Layout(
        tp,
        pp,
        max(1, world // (tp * pp * cp)),
        chunks,
        fixed.micro_batch or 1,
        bool(fixed.sequence_parallel),
        rec,
        bool(fixed.distributed_optimizer),
        kind,
        fixed.first,
        fixed.last,
        cp,
        ep=fixed.ep or 1,
    )
    layout_config(base, plain).check(world)
    groups = base.num_query_groups if base.group_query_attention else None
    check_model_fits(
        make_layout(world, tp, pp, gpus_per_node=gpus_per_node, cp=cp),
        base.num_layers,
        base.num_attention_heads,
        base.vocab_size,
        chunks,
        groups,
    )


def _quick(
    base: TrainConfig,
    layouts: list[Layout],
    gpu: GPUProfile,
    model: dict,
    blocks: int = 0,
    limit: float = math.inf,
) -> tuple[list[Estimate], ConfigError | None]:
    """The quick estimates of ``layouts`` (theoretical bubble where it has a closed form), and
    the first refusal met; ``blocks`` > 0: with the block candidates that could be among the
    ``blocks`` fastest of their context-parallel size and faster than ``limit``
    (block_spans.block_candidates)."""
    out: list[Estimate] = []
    first_error: ConfigError | None = None
    for layout in layouts:
        try:
            out.append(estimate(base, layout, gpu, simulate=False, **model))
        except ConfigError as e:
            first_error = first_error or e
    if blocks:
        out += block_candidates(base, out, gpu, model, blocks, limit)
    return out, first_error


class NoFit(ConfigError):
    """No layout fits; ``estimates`` holds the closest ones."""

    def __init__(self, message: str, estimates: list[Estimate]) -> None:
        super().__init__(message)
        self.estimates = estimates
