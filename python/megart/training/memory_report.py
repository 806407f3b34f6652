"""GPU memory in `megart train`'s reports, as Megatron-LM reports it (its report_memory line and
its --log-memory-to-tensorboard scalars), plus megart's "static" figure: what a run holds from
one iteration to the next (weights, gradients, optimizer state), which `megart plan` predicts
as parameters + gradients + optimizer. Nothing here on CPU: the figures are CUDA's allocator's.
"""

from __future__ import annotations

from typing import Any

import torch

MB = 1024.0 * 1024.0
# The --log-jsonl keys, each from torch.cuda.memory_stats() (torch.cuda.memory_allocated(),
# max_memory_allocated(), memory_reserved() and max_memory_reserved() read the same counters).
STATS = {
    "mem_allocated_bytes": "allocated_bytes.all.current",
    "mem_max_allocated_bytes": "allocated_bytes.all.peak",
    "mem_reserved_bytes": "reserved_bytes.all.current",
    "mem_max_reserved_bytes": "reserved_bytes.all.peak",
    "mem_allocated_count": "allocation.all.current",
}
STATIC = "mem_static_bytes"
# Megatron-LM's --log-memory-to-tensorboard tags, and megart's static figure beside them.
TENSORBOARD_TAGS = {
    "mem-reserved-bytes": "mem_reserved_bytes",
    "mem-allocated-bytes": "mem_allocated_bytes",
    "mem-max-allocated-bytes": "mem_max_allocated_bytes",
    "mem-allocated-count": "mem_allocated_count",
    "mem-static-bytes": STATIC,
}


def static_figure(device: torch.device) -> dict[str, int]:
    """The bytes allocated now, taken at the end of a training step (after the optimizer step,
    once the step's batch and activations are freed, before any evaluation or checkpoint):
    weights, gradients and optimizer state. Adam's state is made at the first step, so the first
    iteration's figure already has it. Empty off CUDA."""
    if device.type != "cuda":
        return {}
    return {STATIC: torch.cuda.memory_allocated(device)}


def sample(device: torch.device) -> dict[str, int]:
    """The allocator's counters now (peaks since the process started, as Megatron's); empty
    off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    # A device that never allocated has no counters yet: zero, not a KeyError.
    return {key: int(stats.get(name, 0)) for key, name in STATS.items()}


def memory_line(rank: int, fig: dict[str, Any]) -> str:
    """Megatron-LM's report_memory line, its four fields as it prints them (log parsers read
    them), then megart's static figure last, where Megatron puts its own optional field."""
    line = (
        f"[Rank {rank}] (after {fig['iteration']} iterations) memory (MB)"
        f" | allocated: {fig['mem_allocated_bytes'] / MB:.2f}"
        f" | max allocated: {fig['mem_max_allocated_bytes'] / MB:.2f}"
        f" | reserved: {fig['mem_reserved_bytes'] / MB:.2f}"
        f" | max reserved: {fig['mem_max_reserved_bytes'] / MB:.2f}"
    )
    if STATIC in fig:
        line += f" | static: {fig[STATIC] / MB:.2f}"
    return line


class MemoryLines:
    """When the memory line is printed: Megatron's rule, at logged iterations until one that is
    past the run's second (its peak then includes a forward and backward with the optimizer
    state already held; the first iteration's does not), on every data-parallel rank 0."""

    def __init__(self, printing: bool, rank: int, start_iteration: int) -> None:
        self.printing, self.rank, self.start = printing, rank, start_iteration

    def line(self, fig: dict[str, Any], logged: bool) -> str | None:
        if not (self.printing and logged and "mem_allocated_bytes" in fig):
            return None
        if fig["iteration"] > self.start + 1:
            self.printing = False  # this is the last one
        return memory_line(self.rank, fig)
