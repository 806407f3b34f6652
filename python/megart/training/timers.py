"""Megatron-LM's per-phase timers: --timing-log-level, --timing-log-option and
--log-timers-to-tensorboard.

Each phase of an iteration is timed on every rank (on a GPU between two device
synchronisations, as Megatron's timers do, so the time is the device's, at the cost of the
overlap the synchronisations stop). Every --log-interval iterations the ranks exchange their
times, which are reported per iteration in milliseconds: (min, max) across ranks (Megatron's
default ``minmax``), the max only, or ``all`` ranks', printed as Megatron prints them, and the max
written to TensorBoard as ``<name>-time`` with --log-timers-to-tensorboard. Level 1 times what
Megatron's level 1 does where megart has the phase; level 2 adds the batch generator. Megatron's
level-2 timers inside the pipeline schedule (forward-compute, backward-compute and the send and
receive waits) are not measured: megart's engine is not instrumented, and --profile traces it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

import megart.distributed as dist

# Megatron-LM's timer names, in its log's order, with the level that shows each.
LEVELS = {
    "forward-backward": 1,
    "layernorm-grads-all-reduce": 1,
    "embedding-grads-all-reduce": 1,
    "all-grads-sync": 1,
    "optimizer-unscale-and-check-inf": 1,
    "optimizer-clip-main-grad": 1,
    "optimizer-count-zeros": 1,
    "optimizer-inner-step": 1,
    "optimizer": 1,
    "batch-generator": 2,
}
OPTIONS = ("max", "minmax", "all")


class Timers:
    """Accumulates each phase's time on this rank until :meth:`report` (every rank calls it
    at the same iterations) gathers and resets them."""

    def __init__(self, level: int, device: torch.device) -> None:
        self.level, self.device = level, device
        self.elapsed = dict.fromkeys(LEVELS, 0.0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as ``name`` (one of LEVELS) when --timing-log-level shows it."""
        if LEVELS[name] > self.level:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.elapsed[name] += time.perf_counter() - start

    def report(self, iterations: int) -> dict[str, list[float]]:
        """Every shown phase's milliseconds per iteration over the last ``iterations``, on each
        rank in rank order (the same on every rank), leaving out phases no rank ran; resets."""
        names = [n for n, level in LEVELS.items() if level <= self.level]
        mine = torch.tensor([self.elapsed[n] * 1e3 / iterations for n in names],
                            dtype=torch.float64, device=self.device)  # fmt: skip
        world = dist.get_world_size()
        every = torch.empty(world * len(names), dtype=torch.float64, device=self.device)
        if world > 1:
            dist.all_gather_into_tensor(every, mine)
        else:
            every.copy_(mine)
        self.elapsed = dict.fromkeys(LEVELS, 0.0)
        per_rank = every.view(world, len(names)).T.tolist()
        return {n: times for n, times in zip(names, per_rank, strict=True) if max(times) > 0}


def timer_lines(times: dict[str, list[float]], option: str) -> str | None:
    """Megatron-LM's report of ``times`` (Timers.report) under --timing-log-option, or None
    when nothing was timed. As Megatron's, min and max leave out ranks that did not run a
    phase."""
    if not times:
        return None
    if option == "all":
        lines = ["times across ranks (ms):"]
        for name, per_rank in times.items():
            lines.append(f"  {name}:")
            lines += [f"     rank {r:2d}: {t:.2f}" for r, t in enumerate(per_rank) if t > 0]
        return "\n".join(lines)
    head = (
        "max time across ranks (ms):" if option == "max" else "(min, max) time across ranks (ms):"
    )
    lines = [head]
    for name, per_rank in times.items():
        ran = [t for t in per_rank if t > 0]
        label = (name + " ").ljust(48, ".")
        shown = f"{max(ran):.2f}" if option == "max" else f"({min(ran):.2f}, {max(ran):.2f})"
        lines.append(f"    {label}: {shown}")
    return "\n".join(lines)


def tensorboard_scalars(times: dict[str, list[float]]) -> dict[str, Any]:
    """Megatron's TensorBoard tags of ``times``: ``<name>-time``, the max across ranks."""
    return {f"{name}-time": max(per_rank) for name, per_rank in times.items()}
