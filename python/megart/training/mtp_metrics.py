"""Multi-token prediction in the trainer (models.mtp): the labels its depths read on a last
stage without the tokens, and the depths' losses an iteration reports, as Megatron-LM logs them
(its MTPLossLoggingHelper): ``mtp_k loss``, depth k's loss (without the scaling factor), the
mean over the iteration's microbatches and the data- and context-parallel ranks. The depths
record their losses when their gradients are seeded (models.moe's tracker under the name
"mtp"), on the last pipeline stage; every tensor-parallel rank computes the same value."""

from __future__ import annotations

from typing import Any

import torch

import megart.distributed as dist
from megart.tensor_parallel._group import group_size
from megart.training.documents import MaskedTargets
from megart.training.pad_tokens import pad_to_zero


def names(depths: int) -> list[str]:
    """Megatron-LM's names of the depths' losses in its log and TensorBoard."""
    return [f"mtp_{k + 1} loss" for k in range(depths)]


def feed_labels(chunks: list[Any], targets: list[Any] | None, pad: int | None) -> None:
    """Hands this rank's microbatches' labels (from ``targets``; None: none) to the chunk
    holding the depths, which reads its tokens from them (Megatron-Core's pad id ``pad``
    mapped to 0, as in the inputs)."""
    for chunk in chunks:
        if getattr(chunk, "mtp", None) is None:
            continue
        if targets is None:
            chunk.mtp.feed(None)
            continue
        labels = [t.labels if isinstance(t, MaskedTargets) else t for t in targets]
        chunk.mtp.feed([pad_to_zero(x, pad) if pad is not None else x for x in labels])


def mtp_losses(chunks: list[Any], cfg: Any, grid: Any, m: int, device: Any) -> dict[str, float]:
    """The iteration's depth losses by name (empty without depths), the same on every rank,
    from what ``chunks`` tracked over ``m`` microbatches (then cleared): taken before the MoE
    losses, whose take clears the whole tracker. (The labels fed stay until the next feed:
    evaluation, without gradients, runs no depth.)"""
    depths = cfg.mtp_num_layers or 0
    if not depths:
        return {}
    sums = torch.zeros(depths, dtype=torch.float64, device=device)
    for chunk in chunks:
        for k, value in chunk.aux_loss_scale.tracked.pop("mtp", {}).items():
            sums[k] += value.to(sums.device)
    dist.all_reduce(sums, group=grid.pp_group)  # from the last stage
    # Each context-parallel rank's part of a depth's loss is its share of the whole
    # sequence's mean over cp (models.mtp): their mean is that loss.
    dist.all_reduce(sums, group=grid.dp_cp_group)
    sums /= m * group_size(grid.dp_cp_group)
    return dict(zip(names(depths), sums.tolist(), strict=True))
