"""Full recomputation by --recompute-method block, searched: for a layout that fits only with
full recomputation, replaying fewer of each chunk's layers than every one of them.

Block N checkpoints the first N layers of each chunk and keeps every save of the others
(models.recompute.recomputed_spans): the fewer it replays, the less time and the more memory.
Both are monotone in N (each of a chunk's layers moved from kept to replayed keeps one input
instead of its whole saves, and adds one layer's forward to the backward), and N at or above
a chunk's layers replays them all as uniform 1 does, in the same time and memory. So on one
layout the block worth planning is the smallest N whose worst rank fits, searched over
1 .. (a chunk's most layers) - 1 on the quick estimate's memory (smallest_block; exact
whatever the schedule: the pairs each rank holds do not depend on the stage times).

It is planned only where it can win: where uniform 1 (the full candidate) fits, since block N
holds at least as much, and where the same layout without recomputation does not fit, since
that one replays nothing (never slower, and its memory fits). megart train runs block with
any N >= 1 on every schedule, interleaved, zb-v and uneven stages included (each chunk its
own first N layers); the estimate runs its checks, and a layout they refuse gets no block.
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from megart.errors import ConfigError
from megart.plan.estimate import Estimate, estimate, work_bound
from megart.plan.hardware import GPUProfile
from megart.plan.layout import ZERO_BUBBLE, Layout
from megart.schedule import theoretical_bubble
from megart.training.config import TrainConfig


def searches_spans(base: TrainConfig, given: bool = False) -> bool:
    """Whether the spans are left to the search: neither --recompute-method nor
    --recompute-num-layers ``given`` (megart plan's command line says; the base config cannot
    tell megart train's defaults, uniform and 1, spelt out from left out), and the base's at
    those defaults (a caller of the search that sets others has given them)."""
    return not given and (base.recompute_method, base.recompute_num_layers) == ("uniform", 1)


def block_candidates(
    base: TrainConfig,
    quick: list[Estimate],
    gpu: GPUProfile,
    model: dict,
    short: int,
    limit: float = math.inf,
) -> list[Estimate]:
    """For each layout of ``quick`` without recomputation that does not fit, the quick
    estimate of its full recomputation under block with the smallest N that fits and replays
    fewer layers than a chunk holds; none where that layout's full candidate in ``quick``
    (uniform 1) does not fit, or block N = a chunk's layers - 1 does not.

    Left out, as they cannot change the search's answer: those that would not be among the
    ``short`` fastest quick estimates of their context-parallel size (the search simulates
    only those; block N is not faster than block 1, nor block 1 than the layout without
    recomputation, which replays nothing), and those that take ``limit`` or longer (block 1's
    least time, _least_time; or, where the quick estimate is the search's last, the layout
    without recomputation's)."""
    full = {_without_recomputation(e.layout): e for e in quick if e.layout.recompute == "full"}
    fitting: dict[int, list[float]] = {}
    for e in quick:
        fitting.setdefault(e.layout.cp, [])
        if e.fits:
            fitting[e.layout.cp].append(e.iteration_time)
    for times in fitting.values():
        times.sort()
    out = []
    for e in sorted(quick, key=lambda e: e.iteration_time):  # the fastest first: bars fall
        layout, times = e.layout, fitting[e.layout.cp]
        bar = times[short - 1] if len(times) >= short else math.inf
        if layout.recompute or e.fits or e.iteration_time > bar:
            continue
        uniform = full.get(layout)
        if uniform is not None and not uniform.fits:
            continue
        final = e.simulated or layout.pp == 1  # the quick estimate is the search's last
        if final:
            bar = min(bar, limit)
        try:
            block = _block_of(base, e, gpu, model, bar, limit)
        except ConfigError:  # megart train refuses it: no block candidate
            continue
        if block is not None:
            out.append(block)
            bisect.insort(times, block.iteration_time)
    return out


def _block_of(
    base: TrainConfig, plain: Estimate, gpu: GPUProfile, model: dict, bar: float, limit: float
) -> Estimate | None:
    """smallest_block of ``plain``'s layout under full recomputation; None too where block 1's
    least time (_least_time) reaches ``limit``."""
    full = dataclasses.replace(plain.layout, recompute="full")
    if limit < math.inf and _least_time(base, _block(full, 1), gpu, plain, model) >= limit:
        return None
    most = max(full.layer_counts(base.num_layers)) // full.chunks
    return smallest_block(base, full, gpu, most - 1, model, bar, plain)


def _least_time(
    base: TrainConfig, layout: Layout, gpu: GPUProfile, plain: Estimate, model: dict
) -> float:
    """A lower bound of ``layout``'s iteration time, quick or simulated: its work alone
    (work_bound), with even stages under 1F1B or interleaving stretched by the schedule's
    bubble, which the simulator reaches only when messages are free (a schedule's makespan
    is its longest path: messages and longer work never shorten it). ``plain``: the layout
    without recomputation, estimated (its microbatches)."""
    work = work_bound(base, layout, gpu, **model)
    if layout.pp == 1 or layout.uneven or layout.kind in ZERO_BUBBLE:
        return work
    bubble = theoretical_bubble(layout.kind, layout.pp, plain.microbatches, layout.chunks)
    return work * (1 + bubble)


def smallest_block(
    base: TrainConfig,
    layout: Layout,
    gpu: GPUProfile,
    most: int,
    model: dict,
    bar: float = math.inf,
    plain: Estimate | None = None,
) -> Estimate | None:
    """The quick estimate of ``layout`` under block N, N the smallest of 1 .. ``most`` that
    fits; None when ``most`` does not fit, or once a block N that does not fit (or ``plain``,
    ``layout`` without recomputation, which replays nothing) is slower than ``bar``: the
    answer, replaying more, is not faster.

    Memory falls as N grows, on each rank by the same bytes for each N (a layer's saves less
    its input, times the pairs the rank holds), so the worst rank's, the largest of those
    lines, is convex: the line through a block that does not fit (``plain`` as N = 0, or N = 1)
    and ``most`` crosses the usable memory at or above the answer. That N and the one below
    it settle it where one rank is the worst throughout; bisection does the rest."""
    if most < 1:
        return None

    def at(n: int) -> Estimate:
        return estimate(base, _block(layout, n), gpu, simulate=False, **model)

    hi = at(most)
    if not hi.fits or most == 1:
        return hi if hi.fits else None
    a, lo = 0, plain
    if lo is None or lo.fits:
        a, lo = 1, at(1)
        if lo.fits:
            return lo
    if lo.iteration_time > bar:
        return None
    b = most  # block a does not fit (``lo``: N = 0 is ``plain``), block b fits (``hi``)
    over, under = lo.memory["total"] - gpu.usable_bytes, gpu.usable_bytes - hi.memory["total"]
    crossing = a + math.ceil(over / (over + under) * (b - a))
    probes = [crossing - 1, crossing]  # popped from the end
    while b - a > 1:
        n = min(max(probes.pop() if probes else (a + b) // 2, a + 1), b - 1)
        e = at(n)
        if e.fits:
            b, hi = n, e
        elif e.iteration_time > bar:
            return None
        else:
            a = n
            probes = []  # the crossing missed, or the N below it fits too: bisect
    return hi


def _block(layout: Layout, n: int) -> Layout:
    return dataclasses.replace(layout, recompute_method="block", recompute_num_layers=n)


def _without_recomputation(layout: Layout) -> Layout:
    return dataclasses.replace(
        layout, recompute=None, recompute_method=None, recompute_num_layers=None
    )
