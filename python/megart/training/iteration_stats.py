"""Megatron-LM's optional figures of an iteration: --log-params-norm, the L2 norm of the weights
after the step, and --log-num-zeros-in-grad, how many gradient elements the step read as zero.

Both read what Megatron reads: the tensors the optimizer steps (the fp32 main weights and their
gradients under --half-weights, this rank's slices under --use-distributed-optimizer), and
count each element of the model once across the ranks by gradient clipping's rule
(megart.training.grad_norm.counted_in_norm: a tensor-parallel replica on tensor-parallel rank
0 only, the tied embedding on the first stage only). The sums run over the model-parallel
ranks, or every rank where the distributed optimizer shards over data parallelism, so each
rank ends with the same figure. Under expert parallelism each expert counts once too: the
experts' sums are added over the expert-parallel group (or, sharded, over every rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.optim.clip import grad_sum_of_squares
from megart.tensor_parallel import grad_of
from megart.training.distributed_optimizer import DistributedOptimizer
from megart.training.expert_grads import is_expert
from megart.training.grad_norm import counted_in_norm
from megart.training.main_weights import MainWeights
from megart.training.optimizer import counted_pieces


def _counted(
    chunks: list[torch.nn.Module], grid: Any, optimizer: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, ProcessGroup | None]:
    """The stepped tensors this rank counts (each with the gradient the step reads as its
    ``.grad``): the dense ones, the experts spread over expert parallelism (None: none are
    apart), and the group whose ranks together count the model once (None: every rank).
    Without the distributed optimizer each rank of an expert-parallel group holds other
    experts, so theirs are summed over that group first (_total); the distributed optimizer's
    slices, summed over every rank, count each expert once already (each of an expert's
    expert-data-parallel ranks steps its own slice of it)."""
    if isinstance(optimizer, DistributedOptimizer):
        return counted_pieces(chunks, optimizer, grid.tp_rank), None, None
    main_of = {}
    if isinstance(optimizer, MainWeights):
        main_of = {id(p): m for p, m in zip(optimizer.params, optimizer.mains, strict=True)}
    dense: list[torch.Tensor] = []
    experts: list[torch.Tensor] = []  # marked only under expert parallelism (models.moe)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if counted_in_norm(chunk, name, p, grid.tp_rank):
                stepped = main_of.get(id(p))
                if stepped is None:  # the parameter itself, its gradient where megart keeps it
                    stepped = p.detach()
                    stepped.grad = grad_of(p)
                (experts if is_expert(p) else dense).append(stepped)
    spread = getattr(grid, "ep_group", None) is not None
    return dense, experts if spread else None, grid.mp_group


def _total(
    chunks: list[torch.nn.Module],
    grid: Any,
    optimizer: Any,
    measure: Callable[[list[torch.Tensor]], torch.Tensor],
) -> float:
    """``measure`` (a float64 [1] tensor of a list of counted tensors) summed over the model:
    the spread experts' over their expert-parallel group, then everything over the group
    that counts the model once."""
    dense, experts, group = _counted(chunks, grid, optimizer)
    local = measure(dense)
    if experts is not None:
        spread = measure(experts)
        dist.all_reduce(spread, group=grid.ep_group)
        local += spread
    return _summed(local, group)


def _summed(local: torch.Tensor, group: ProcessGroup | None) -> float:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
    return local.item()


def params_norm(chunks: list[torch.nn.Module], grid: Any, optimizer: Any, device: Any) -> float:
    """The L2 norm of every weight of the model (Megatron's calc_params_l2_norm)."""

    def squares(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(1, dtype=torch.float64, device=device)
        return grad_sum_of_squares([t.detach() for t in tensors]).reshape(1)

    return math.sqrt(_total(chunks, grid, optimizer, squares))


def zeros_in_grads(chunks: list[torch.nn.Module], grid: Any, optimizer: Any, device: Any) -> int:
    """How many elements of the model's gradients are zero (Megatron's count_zeros_fp32)."""

    def zeros(tensors: list[torch.Tensor]) -> torch.Tensor:
        local = torch.zeros(1, dtype=torch.float64, device=device)  # exact to 2^53 elements
        for t in tensors:
            if t.grad is not None:
                local += t.grad.numel() - torch.count_nonzero(t.grad)
        return local

    return int(_total(chunks, grid, optimizer, zeros))
