"""The mixture-of-experts losses an iteration reports, as Megatron-LM logs them (its
track_moe_metrics): ``load_balancing_loss`` (``seq_load_balancing_loss`` under seq_aux_loss,
``global_load_balancing_loss`` under global_aux_loss) and ``z_loss``, each without its
coefficient, the mean over the MoE layers and the microbatches of the iteration (multi-token
prediction's depths count among the MoE layers, as Megatron-LM counts them: see moe_losses).
With --moe-per-layer-logging each layer's too (the mean over the microbatches), under
Megatron-Core's names ``moe/{name}_layer_{i}`` (to TensorBoard, as Megatron's tracker writes
them, and to --log-jsonl; the depths' layers numbered after the decoder's).

The MoE layers record their losses when their gradients are seeded (models.moe.AuxLossScale).
Each layer lives on one pipeline stage, so the stages' sums add up. Under tensor or context
parallelism a rank's load-balancing loss is its share of the sequence's (the shares add up, as
Megatron sums them over its tp_cp group), and its z-loss is the mean over its own tokens (the
ranks' mean is the sequence's: Megatron logs one rank's instead); data-parallel ranks are
averaged, as Megatron averages them, but for the global loss, whose ranks' shares add up.
"""

from __future__ import annotations

from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.tensor_parallel._group import group_size

# What each loss is over the tensor- and context-parallel ranks: their sum or their mean.
SHARED = {
    "load_balancing_loss": "sum",
    "seq_load_balancing_loss": "sum",
    "global_load_balancing_loss": "sum",
    "z_loss": "mean",
}
# Summed over the data-parallel ranks, not averaged: each rank's is its share of the global
# batch's loss (Megatron reduces it over its tp_dp_cp group).
DP_SUMMED = ("global_load_balancing_loss",)


def tracked_names(cfg: Any) -> list[str]:
    """The losses a model's MoE layers compute in training (GPTConfig ``cfg``)."""
    if cfg.num_experts is None:
        return []
    kind = cfg.moe_router_load_balancing_type if cfg.moe_aux_loss_coeff > 0 else None
    on = {
        "load_balancing_loss": kind == "aux_loss",
        "seq_load_balancing_loss": kind == "seq_aux_loss",
        "global_load_balancing_loss": kind == "global_aux_loss",
        "z_loss": bool(cfg.moe_z_loss_coeff),
    }
    return [name for name, computed in on.items() if computed]


def moe_losses(
    chunks: list[Any], cfg: Any, grid: Any, m: int, device: Any, per_layer: bool = False
) -> dict[str, float]:
    """The iteration's MoE losses by name (empty without any), the same on every rank, from
    what ``chunks`` tracked over ``m`` microbatches (then cleared). ``per_layer``
    (--moe-per-layer-logging): each layer's too, under Megatron-Core's names
    (layer_names), every layer's including the dense ones' (0), as its tracker writes them;
    the mean over the MoE layers of a loss's values is its logged value."""
    names = tracked_names(cfg)
    if not names:
        return {}
    # [losses, layers]: each layer's sum over the microbatches, on the stage that holds it;
    # multi-token prediction's depths' layers after the decoder's, as Megatron-Core's tracker.
    depths = cfg.mtp_num_layers or 0
    sums = torch.zeros(len(names), cfg.num_layers + depths, dtype=torch.float64, device=device)
    for chunk in chunks:
        tracked = chunk.aux_loss_scale.take()
        for i, name in enumerate(names):
            for layer, value in tracked.get(name, {}).items():
                sums[i, layer] += value.to(sums.device)
    dist.all_reduce(sums, group=grid.pp_group)
    for group in (grid.tp_group, grid.cp_group):
        _over(sums, names, group)
    dist.all_reduce(sums, group=grid.dp_group)
    sums /= m
    for i, name in enumerate(names):
        if name not in DP_SUMMED:  # the data-parallel ranks' mean
            sums[i] /= group_size(grid.dp_group)
    # Megatron-LM's count (track_moe_metrics): the decoder's MoE layers and every depth, even
    # where the depths' layers are dense (the last decoder layer's kind).
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) + depths
    means = sums.sum(dim=1) / layers
    out = {name: float(value) for name, value in zip(names, means.tolist(), strict=True)}
    if per_layer:
        for name, row in zip(names, sums.tolist(), strict=True):
            out.update(zip(layer_names(name, len(row)), row, strict=True))
    return out


def layer_names(name: str, layers: int) -> list[str]:
    """Megatron-Core's per-layer names of loss ``name`` (its track_moe_metrics under
    --moe-per-layer-logging): ``moe/{name}_layer_{i}``, i the 0-based layer."""
    return [f"moe/{name}_layer_{i}" for i in range(layers)]


def _over(sums: torch.Tensor, names: list[str], group: ProcessGroup | None) -> None:
    """Each loss's sum or mean over ``group``'s ranks (SHARED), in place."""
    size = group_size(group)
    if size == 1:
        return
    dist.all_reduce(sums, group=group)
    for i, name in enumerate(names):
        if SHARED[name] == "mean":
            sums[i] /= size
