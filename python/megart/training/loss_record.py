"""The loss a run reports: each microbatch's (loss, weight) as the last pipeline stage computes
it, summed over the global batch on every rank.

A microbatch's weight is 1 (its loss a mean, and every microbatch and context-parallel part
holds as many tokens, so the mean of the means is the batch's), or with --eod-mask-loss its
unmasked token count (its loss a masked sum): the reported loss is Megatron-LM's, the global
batch's per-token mean.
"""

from __future__ import annotations

import torch

import megart.distributed as dist


class LossRecord:
    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor | float]] = []

    def add(self, loss: torch.Tensor, weight: torch.Tensor | float) -> None:
        self.parts.append((loss.detach(), weight))

    def clear(self) -> None:
        self.parts.clear()

    def take(self) -> tuple[float, float]:
        """The sums of the recorded losses and of their weights (then cleared)."""
        parts, self.parts = self.parts, []
        return sum(float(x) for x, _ in parts), sum(float(w) for _, w in parts)


def reduce_sums(sums: torch.Tensor, grid: object) -> None:
    """(loss sum, weight sum) of the whole global batch on every rank: only the last stage
    adds a loss, and the data- and context-parallel ranks each hold their part of the batch."""
    dist.all_reduce(sums, group=grid.pp_group)
    dist.all_reduce(sums, group=grid.dp_cp_group)
