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
) -> float:
    """Returns the global gradient norm over ``mp_group`` (the same on each of its ranks) and
    scales every gradient of ``chunks`` to ``max_norm`` when it is larger (0: never)."""
    counted, grads = [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            grad = grad_of(p)
            if grad is None:
                continue
            grads.append(grad)
            if counted_in_norm(chunk, name, p, tp_rank):
                counted.append(grad)
    return clip_grads(counted, grads, mp_group, max_norm, device)


def clip_grads(
    counted: list[torch.Tensor],
    grads: list[torch.Tensor],
    group: ProcessGroup | None,
    max_norm: float,
    device: torch.device,
) -> float:
    """The norm of ``counted`` summed over ``group`` (None: every rank), and ``grads`` scaled
    to ``max_norm`` when it is larger (0: never). Each element of the model must be counted on
    exactly one rank of the group."""
    # float64 sums of squares (megart's multi-tensor sweep on CPU, on the device on GPU), read
    # on the host once.
    total = (
        grad_sum_of_squares(counted).reshape(1)
        if counted
        else torch.zeros(1, dtype=torch.float64, device=device)
    )
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    norm = math.sqrt(total.item())
    if max_norm > 0 and norm > max_norm and grads:
        scale_grads_(grads, max_norm / (norm + 1e-6))
    return norm
