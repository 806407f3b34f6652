"""Megatron-LM's optional figures of an iteration: --log-params-norm, the L2 norm of the weights
after the step, and --log-num-zeros-in-grad, how many gradient elements the step read as zero.

Both read what Megatron reads: the tensors the optimizer steps (the fp32 main weights and their
gradients under --half-weights, this rank's slices under --use-distributed-optimizer), and
count each element of the model once across the ranks by gradient clipping's rule
(megart.training.grad_norm.counted_in_norm: a tensor-parallel replica on tensor-parallel rank
0 only, the tied embedding on the first stage only). The sums run over the model-parallel
ranks, or every rank where the distributed optimizer shards over data parallelism, so each
rank ends with the same figure.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.optim.clip import grad_sum_of_squares
from megart.tensor_parallel import grad_of
from megart.training.distributed_optimizer import DistributedOptimizer
from megart.training.grad_norm import counted_in_norm
from megart.training.main_weights import MainWeights
from megart.training.optimizer import counted_pieces


def _counted(
    chunks: list[torch.nn.Module], grid: Any, optimizer: Any
) -> tuple[list[torch.Tensor], ProcessGroup | None]:
    """The stepped tensors this rank counts (each with the gradient the step reads as its
    ``.grad``), and the group whose ranks together count the model once (None: every rank)."""
    if isinstance(optimizer, DistributedOptimizer):
        return counted_pieces(chunks, optimizer, grid.tp_rank), None
    main_of = {}
    if isinstance(optimizer, MainWeights):
        main_of = {id(p): m for p, m in zip(optimizer.params, optimizer.mains, strict=True)}
    counted = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if counted_in_norm(chunk, name, p, grid.tp_rank):
                stepped = main_of.get(id(p))
                if stepped is None:  # the parameter itself, its gradient where megart keeps it
                    stepped = p.detach()
                    stepped.grad = grad_of(p)
                counted.append(stepped)
    return counted, grid.mp_group


def _summed(local: torch.Tensor, group: ProcessGroup | None) -> float:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, group=group)
    return local.item()


def params_norm(chunks: list[torch.nn.Module], grid: Any, optimizer: Any, device: Any) -> float:
    """The L2 norm of every weight of the model (Megatron's calc_params_l2_norm)."""
    tensors, group = _counted(chunks, grid, optimizer)
    local = (
        grad_sum_of_squares([t.detach() for t in tensors]).reshape(1)
        if tensors
        else torch.zeros(1, dtype=torch.float64, device=device)
    )
    return math.sqrt(_summed(local, group))


def zeros_in_grads(chunks: list[torch.nn.Module], grid: Any, optimizer: Any, device: Any) -> int:
    """How many elements of the model's gradients are zero (Megatron's count_zeros_fp32)."""
    tensors, group = _counted(chunks, grid, optimizer)
    local = torch.zeros(1, dtype=torch.float64, device=device)  # exact to 2^53 elements
    for t in tensors:
        if t.grad is not None:
            local += t.grad.numel() - torch.count_nonzero(t.grad)
    return int(_summed(local, group))
