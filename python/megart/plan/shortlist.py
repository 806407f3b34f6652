"""The search's shortlist and ranking: the fastest few of each context-parallel size estimated
again with the schedule simulator, the time a layout must beat to enter the table, the layouts
whose work alone could, the order of the table (fastest fitting first, then least missing
memory), and why each loses to the recommended."""

from __future__ import annotations

import math

from megart.errors import ConfigError
from megart.plan.estimate import Estimate, estimate, work_bound
from megart.plan.hardware import GIB, GPUProfile
from megart.plan.layout import Layout
from megart.training.config import TrainConfig


def simulated(
    base: TrainConfig, quick: list[Estimate], gpu: GPUProfile, short: int, model: dict
) -> list[Estimate]:
    """The ``short`` best of ``quick`` for each context-parallel size, estimated with the
    schedule simulator (those quick already simulated kept as they are)."""
    taken: dict[int, int] = {}
    out = []
    for e in sorted(quick, key=rank):
        if taken.setdefault(e.layout.cp, 0) < short:
            taken[e.layout.cp] += 1
            done = e.simulated or e.layout.pp == 1  # one stage: no schedule to simulate
            out.append(e if done else estimate(base, e.layout, gpu, simulate=True, **model))
    return out


def time_to_beat(found: list[Estimate], keep: int) -> float:
    """The time a layout must beat to enter the ``keep`` shown: the keep-th fitting one's
    (infinite while fewer fit)."""
    fitting = sorted(e.iteration_time for e in found if e.fits)
    return fitting[keep - 1] if len(fitting) >= keep else math.inf


def could_enter(
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


def rank(e: Estimate) -> tuple:
    """The table's order: those that fit, fastest first, then the others, least missing
    memory first."""
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
