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


def global_loss_and_p2p_bytes(
    losses: LossRecord, grid: object, device: torch.device
) -> tuple[float, int]:
    """The global batch's mean loss (``losses``' records taken) and the pipeline bytes all
    ranks sent this iteration, the same on every rank, so that any rank can report them."""
    loss, weight = losses.take()
    figures = torch.tensor(
        [loss, weight, float(sum(dist.bytes_sent(grid.pp_group).values()))],
        dtype=torch.float64,
        device=device,  # nccl groups move device memory only
    )
    reduce_sums(figures[:2], grid)
    dist.all_reduce(figures[2:])  # bytes: summed over every rank
    return (figures[0] / figures[1]).item(), int(figures[2].item())
