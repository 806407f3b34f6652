"""Search the layouts a user left open and recommend the fastest that fits.

Every combination of the open flags that megart train accepts is estimated quickly (the
theoretical bubble and in-flight counts; zero-bubble schedules are simulated even then, their
bubble having no closed form for unequal F, I and W times); the fastest few are then estimated
again with the schedule simulator, which decides the ranking. The schedules tried on p > 1
stages: 1F1B, each interleaving that divides the layers, and for megart's runtime zb-h1 and
zb-v.

Context parallelism left out is searched (megart's runtime only): C = 1 and each power of two
that cuts the sequence into 2 C chunks and divides the GPUs, its ranks placed as megart's grid
places them (tp-cp-dp-pp: the C ranks t apart, d x C averaging gradients); with each t only the
C that megart train's context-parallel checks accept (--cp-comm-type a2a: heads and query
groups per tensor-parallel rank divisible by C). Layouts with C = 1
are searched exactly as when --context-parallel-size 1 is given, so the recommendation is never
slower than that one; those with C > 1 then enter where they can: those whose work alone
(estimate.work_bound, which no schedule shortens) already takes longer than the slowest of the
table's fitting layouts are not estimated, and the fastest few are simulated beside the
others. With C > 1 only micro-batch 1 is tried: b = 2k at C runs each rank's tokens, the same
m, the same FLOPs and gradient traffic as k at C / 2, whose exchanges are fewer and smaller
(and whose gathered keys and values are fewer; under a2a each of its all-to-alls sends
(C/2 - 1)/(C/2) of the same buffer, not (C - 1)/C): never faster, and never less memory but for
the per-microbatch tables of the rank's s/C rows (rope's cos and sin, learned positions' index).
One exception: a2a at C = 2 against one process with rope keeps less (its attention's 5 h per
token against the fused q/k/v output and rope's q and k, 7 h), and b = 1 at C = 2 less again;
a b = 2 at C = 2 faster than b = 1 there, where one process does not fit, is not looked for.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from megart.errors import ConfigError
from megart.models.window import any_windowed
from megart.parallel.checks import check_model_fits
from megart.parallel.layout import divisors, make_layout
from megart.plan.block_spans import block_candidates, searches_spans
from megart.plan.estimate import Estimate, estimate, work_bound
from megart.plan.hardware import GIB, GPUProfile
from megart.plan.layout import ZERO_BUBBLE, Layout, layout_config
from megart.training.config import TrainConfig
from megart.training.context_parallel_checks import check_context_parallel

RECOMPUTE = (None, "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16)  # 16: SC21 Table 1 ran 1.7B-7.5B at 16 (Megatron-LM examples/sc21)
MAX_CHUNKS = 8


@dataclass(frozen=True)
class Fixed:
    """The layout flags the user gave (None: search it)."""

    tp: int | None = None
    pp: int | None = None
    chunks: int | None = None
    micro_batch: int | None = None
    sequence_parallel: bool | None = None
    recompute: str | None | bool = False  # False: search; None: no recomputation
    distributed_optimizer: bool | None = None
    schedule: str | None = None  # --pipeline-schedule (None: search it)
    first: int | None = None  # --decoder-first-pipeline-num-layers (uneven stages; not searched)
    last: int | None = None  # --decoder-last-pipeline-num-layers
    cp: int | None = None  # --context-parallel-size (None: search it)
    # --recompute-method or --recompute-num-layers given: full recomputation runs the base
    # config's spans, even megart train's defaults (uniform 1) spelt out. False: block N is
    # searched where the base's are those defaults (block_spans.searches_spans).
    spans: bool = False


def _schedules(fixed: Fixed, p: int, num_layers: int, zero_bubble: bool) -> list[tuple]:
    """(chunks, schedule) pairs to try on p stages: 1F1B and each interleaving that divides
    the layers, and (``zero_bubble``: the runtime has them) zb-h1 and zb-v; those the user
    named only. A schedule of None is megart train's default for its chunks."""
    if p == 1:  # one stage: megart train interleaves nothing, and zb-v folds its layers in two
        if fixed.schedule == "interleaved" and not fixed.chunks:
            return []
        if fixed.schedule == "zb-v":
            return [(2, "zb-v")] if num_layers % 2 == 0 else []
        return [(fixed.chunks or 1, None)]
    if fixed.chunks:  # --num-layers-per-virtual-pipeline-stage: interleaved
        return [(fixed.chunks, None)]
    uneven = fixed.first is not None or fixed.last is not None
    # Uneven stages: megart train's checks refuse the chunks that do not divide them.
    inter = [(v, None) for v in range(2, MAX_CHUNKS + 1) if uneven or num_layers % (p * v) == 0]
    even_zb_v = num_layers % (2 * p) == 0 and (not uneven or fixed.schedule == "zb-v")
    zb = [(1, "zb-h1")] + ([(2, "zb-v")] if even_zb_v else [])
    by_name = {"1f1b": [(1, None)], "interleaved": inter, "zb-h1": zb[:1], "zb-v": zb[1:]}
    if fixed.schedule is not None:
        return by_name[fixed.schedule]
    return [(1, None)] + inter + (zb if zero_bubble else [])


def context_parallel_sizes(base: TrainConfig, world: int, fixed: Fixed, megart: bool) -> list[int]:
    """The context-parallel sizes to try: the one given; else 1 and each power of two C that
    cuts the sequence into 2 C equal chunks (megart's load-balanced split) and divides the
    GPUs (candidates keeps those megart train accepts with each t). 1 alone for Megatron-LM's
    runtime, whose exchanges the planner does not model, and for the ring through windowed
    layers (windowed_ring)."""
    if fixed.cp is not None:
        return [fixed.cp]
    if not megart or windowed_ring(base):
        return [1]
    out, cp = [1], 2
    while world % cp == 0 and base.seq_length % (2 * cp) == 0:
        out.append(cp)
        cp *= 2
    return out


def windowed_ring(base: TrainConfig) -> bool:
    """Whether context parallelism would run the ring (--cp-comm-type p2p) through layers with
    a sliding window: those blocks are explicit fp32 products (models.ring_attention), which
    the planner does not model (it would time them as the flash blocks of other layers)."""
    cfg = base.gpt_config()
    windowed = any_windowed(cfg.window_size, cfg.window_attn_skip_freq, cfg.num_layers)
    return base.cp_comm_type == "p2p" and windowed


def candidates(
    base: TrainConfig, world: int, gpu: GPUProfile, fixed: Fixed, megart: bool = True
) -> list[Layout]:
    """Every layout within ``fixed`` that passes megart train's checks; ``megart``: the
    runtime is megart's (zero-bubble schedules, context parallelism searched, and its rank
    grid's rule on nodes of the profile's size), else Megatron-LM's."""
    heads = base.num_query_groups if base.group_query_attention else base.num_attention_heads
    # Searched tensor-parallel groups stay inside a node (t divides the node's GPUs).
    tps = [fixed.tp] if fixed.tp else [t for t in divisors(world) if gpu.gpus_per_node % t == 0]
    cps = context_parallel_sizes(base, world, fixed, megart)
    out = []
    for t in tps:
        if fixed.tp is None and heads % t:
            continue
        for cp in cps:  # d = world / (t cp p)
            if fixed.cp is None and not _runs_context_parallel(base, t, cp):
                continue
            out += _layouts(base, world, gpu, fixed, megart, t, cp)
    return out


def _runs_context_parallel(base: TrainConfig, t: int, cp: int) -> bool:
    """Whether megart train's context-parallel checks accept a searched ``cp`` with tensor-
    parallel size ``t`` (sequence parallelism, searched apart, left out)."""
    probe = dataclasses.replace(
        base, tensor_model_parallel_size=t, context_parallel_size=cp, sequence_parallel=False
    )
    try:
        check_context_parallel(probe)
    except ConfigError:
        return False
    return True


def _layouts(
    base: TrainConfig, world: int, gpu: GPUProfile, fixed: Fixed, megart: bool, t: int, cp: int
) -> list[Layout]:
    """candidates() of tensor-parallel size ``t`` and context-parallel size ``cp``."""
    searched_cp = cp > 1 and fixed.cp is None
    # Sequence parallelism splits each rank's s/cp tokens over t (megart train refuses else).
    sp_fits = (base.seq_length // cp) % t == 0
    if searched_cp and fixed.sequence_parallel and not sp_fits:
        return []
    tc = t * cp
    pps = [fixed.pp] if fixed.pp else divisors(world // tc) if world % tc == 0 else []
    out = []
    for p in pps:
        if world % (tc * p):
            continue
        if fixed.pp is None and base.num_layers % p:
            continue
        d = world // (tc * p)
        if megart and _grid_refuses(world, t, p, gpu.gpus_per_node, cp):
            continue
        kinds = _schedules(fixed, p, base.num_layers, megart)
        bs = [fixed.micro_batch] if fixed.micro_batch else list(MICRO_BATCHES)
        if searched_cp and not fixed.micro_batch:
            bs = [1]  # b > 1 at C is dominated by b / 2 at C / 2 (the module's doc)
        bs = [b for b in bs if fixed.micro_batch or base.global_batch_size % (b * d) == 0]
        sps = (
            [fixed.sequence_parallel]
            if fixed.sequence_parallel is not None
            else ([False, True] if t > 1 and (sp_fits or not searched_cp) else [False])
        )
        recs = RECOMPUTE if fixed.recompute is False else (fixed.recompute,)
        dos = (
            [fixed.distributed_optimizer]
            if fixed.distributed_optimizer is not None
            else ([False, True] if d * cp > 1 else [False])
        )
        for (v, kind), b, sp, rec, do in itertools.product(kinds, bs, sps, recs, dos):
            m = base.global_batch_size // (b * d) if b * d else 0
            # Interleaved (a given --num-layers-per-virtual-pipeline-stage is, to megart
            # train, even at one chunk a rank): microbatches a multiple of the stages.
            interleaved = v > 1 or fixed.schedule == "interleaved"
            if kind is None and interleaved and (m == 0 or m % p):
                continue
            if kind == "zb-v" and m < 2 * p:
                continue
            out.append(Layout(t, p, d, v, b, sp, rec, do, kind, fixed.first, fixed.last, cp))
    return out


def _grid_refuses(world: int, t: int, p: int, gpus_per_node: int, cp: int = 1) -> bool:
    """Whether megart's rank grid refuses (t, p, cp) on nodes of ``gpus_per_node`` GPUs: a
    pipeline hop between nodes that changes rail (GridLayout's rule; Megatron-LM has no such
    rule)."""
    try:
        make_layout(world, t, p, gpus_per_node=gpus_per_node, cp=cp)
    except ConfigError:
        return True
    return False


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
    best = _simulated(base, quick, gpu, short, model)
    if split:
        limit = _time_to_beat(best, keep)
        entering = _could_enter(base, split, gpu, limit, model)
        more, error = _quick(base, entering, gpu, model, blocks, limit)
        first_error = first_error or error
        quick += more
        best += _simulated(base, more, gpu, short, model)
    if not quick:
        if first_error is not None:
            raise first_error
        _explain(base, world, fixed, gpu.gpus_per_node if megart else None)
        raise ConfigError(
            f"no layout of {world} GPUs runs this model with global batch "
            f"{base.global_batch_size}: check that the batch splits over data parallelism"
        )
    best.sort(key=_rank)
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


def _simulated(
    base: TrainConfig, quick: list[Estimate], gpu: GPUProfile, short: int, model: dict
) -> list[Estimate]:
    """The ``short`` best of ``quick`` for each context-parallel size, estimated with the
    schedule simulator (those quick already simulated kept as they are)."""
    taken: dict[int, int] = {}
    out = []
    for e in sorted(quick, key=_rank):
        if taken.setdefault(e.layout.cp, 0) < short:
            taken[e.layout.cp] += 1
            done = e.simulated or e.layout.pp == 1  # one stage: no schedule to simulate
            out.append(e if done else estimate(base, e.layout, gpu, simulate=True, **model))
    return out


def _time_to_beat(found: list[Estimate], keep: int) -> float:
    """The time a layout must beat to enter the ``keep`` shown: the keep-th fitting one's
    (infinite while fewer fit)."""
    fitting = sorted(e.iteration_time for e in found if e.fits)
    return fitting[keep - 1] if len(fitting) >= keep else math.inf


def _could_enter(
    base: TrainConfig, layouts: list[Layout], gpu: GPUProfile, limit: float, model: dict
) -> list[Layout]:
    """The layouts whose work alone (work_bound, which no schedule shortens) takes less than
    ``limit``, and those megart train refuses (left to estimate() to say why)."""
    out = []
    for layout in layouts:
        try:
            if work_bound(base, layout, gpu, **model) < limit:
                out.append(layout)
        except ConfigError:
            out.append(layout)
    return out


class NoFit(ConfigError):
    """No layout fits; ``estimates`` holds the closest ones."""

    def __init__(self, message: str, estimates: list[Estimate]) -> None:
        super().__init__(message)
        self.estimates = estimates


def _rank(e: Estimate) -> tuple:
    return (not e.fits, e.missing_bytes if not e.fits else e.iteration_time)


def why_slower(e: Estimate, best: Estimate) -> str:
    """Why ``e`` loses to ``best``: it does not fit, or the part of its time that grew most."""
    if not e.fits:
        return f"does not fit: {e.missing_bytes / GIB:.1f} GiB missing"
    if e is best:
        return "recommended"
    diff = {k: e.time[k] - best.time[k] for k in e.time if k != "iteration"}
    part = max(diff, key=diff.get)
    slower = e.iteration_time / best.iteration_time - 1
    what = part.replace("_", " ")
    return f"+{100 * slower:.1f}% time, most from {what} (+{diff[part] * 1e3:.0f} ms)"
