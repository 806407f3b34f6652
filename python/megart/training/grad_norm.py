"""Gradient clipping by the global norm across model parallelism, as Megatron-LM clips: the norm
counts each parameter once over the tensor- and pipeline-parallel ranks that hold the model,
and every local gradient (replicas included) is scaled by the same factor."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.optim.clip import grad_sum_of_squares, scale_grads_
from megart.tensor_parallel import grad_of


def counted_in_norm(chunk: torch.nn.Module, name: str, p: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank counts p in the global norm: a parameter replicated across tensor
    parallelism on tensor-parallel rank 0 only, the tied embedding on the first stage only."""
    if not hasattr(p, "partition_dim") and tp_rank != 0:
        return False
    return not (name == "wte.weight" and chunk.last and not chunk.first)


def clip_grad_norm(
    chunks: Sequence[torch.nn.Module],
    tp_rank: int,
    mp_group: ProcessGroup,
    max_norm: float,
    device: torch.device,
    ep_group: ProcessGroup | None = None,
) -> float:
    """Returns the global gradient norm over ``mp_group`` (the same on each of its ranks) and
    scales every gradient of ``chunks`` to ``max_norm`` when it is larger (0: never). Under
    expert parallelism (``ep_group``) each rank holds other experts: theirs are summed over
    it too, so that each expert counts once, as Megatron-Core's expert-model-parallel norm."""
    counted, spread, grads = [], [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            grad = grad_of(p)
            if grad is None:
                continue
            grads.append(grad)
            if counted_in_norm(chunk, name, p, tp_rank):
                expert = ep_group is not None and getattr(p, "expert_parallel", False)
                (spread if expert else counted).append(grad)
    if ep_group is None:
        return clip_grads(counted, grads, mp_group, max_norm, device)
    return clip_grads(counted, grads, mp_group, max_norm, device, (spread, ep_group))


def clip_grads(
    counted: list[torch.Tensor],
    grads: list[torch.Tensor],
    group: ProcessGroup | None,
    max_norm: float,
    device: torch.device,
    spread: tuple[list[torch.Tensor], ProcessGroup] | None = None,
) -> float:
    """The norm of ``counted`` summed over ``group`` (None: every rank), and ``grads`` scaled
    to ``max_norm`` when it is larger (0: never). Each element of the model must be counted on
    exactly one rank of the group. ``spread``: more gradients to count, each of them on one
    rank of its group (expert parallelism's experts), summed over that group first."""
    # float64 sums of squares (megart's multi-tensor sweep on CPU, on the device on GPU), read
    # on the host once.
    total = _sum_of_squares(counted, device)
    if spread is not None:
        experts = _sum_of_squares(spread[0], device)
        dist.all_reduce(experts, group=spread[1])
        total += experts
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    norm = math.sqrt(total.item())
    if max_norm > 0 and norm > max_norm and grads:
        scale_grads_(grads, max_norm / (norm + 1e-6))
    return norm


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The float64 sum of squares of ``grads``, a [1] tensor (zero for none)."""
    if not grads:
        return torch.zeros(1, dtype=torch.float64, device=device)
    return grad_sum_of_squares(grads).reshape(1)
