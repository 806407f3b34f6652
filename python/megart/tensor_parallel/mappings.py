"""The communication at the edges of tensor-parallel regions, as autograd functions.

Each mapping is a pair: what the forward pass does, and the transpose the backward pass must do
so gradients stay correct. ``group`` is always explicit; None (or a group of one) makes every
mapping the identity, so the same model code runs with and without tensor parallelism.

| mapping                              | forward                  | backward                     |
|--------------------------------------|--------------------------|------------------------------|
| copy_to_region                       | identity                 | all-reduce                   |
| reduce_from_region                   | all-reduce               | identity                     |
| scatter_to_region                    | keep my last-dim slice   | all-gather along last dim    |
| gather_from_region                   | all-gather along last dim| keep my last-dim slice       |
| scatter_to_sequence_region           | keep my slice of ``dim`` | all-gather along ``dim``     |
| gather_from_sequence_region          | all-gather along ``dim`` | reduce-scatter along ``dim`` |
|   (``reduce_grad=False``)            | all-gather along ``dim`` | keep my slice of ``dim``     |
| reduce_scatter_to_sequence_region    | reduce-scatter ``dim``   | all-gather along ``dim``     |

The sequence-parallel mappings default to ``dim=0``: the sequence dimension of the [s, b, h]
activation layout. Slices are taken in group-rank order.
"""

from __future__ import annotations

from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.tensor_parallel._group import divide, group_rank, group_size

# ---------------------------------------------------------------------------------------------
# The communication itself (no autograd). The transport moves contiguous memory, so every
# helper lays its operand out contiguously first, and never writes into its argument: the
# argument may be an autograd-saved tensor or a gradient another branch also reads.


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out, work = start_all_reduce(x, group)
    work.wait()
    return out


def start_all_reduce(x: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Starts the sum of ``x`` over ``group`` into a new tensor: (that tensor, its Work)."""
    out = x.clone(memory_format=torch.contiguous_format)
    return out, dist.all_reduce(out, group=group, async_op=True)


def _split(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    size = group_size(group)
    divide(x.shape[dim], size, f"dimension {dim} of a {tuple(x.shape)} tensor")
    return x.chunk(size, dim)[group_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    # The transport concatenates along the flat memory, i.e. along dim 0; other dims go there
    # and back. Rank r's block lands at rows [r*n, (r+1)*n), which is the order we want.
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((group_size(group) * front.shape[0], *front.shape[1:]))
    dist.all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    out, work = start_reduce_scatter(x, group, dim)
    work.wait()
    return out.contiguous()


def start_reduce_scatter(
    x: torch.Tensor, group: ProcessGroup, dim: int = 0
) -> tuple[torch.Tensor, dist.Work]:
    """Starts the sum of ``x`` over ``group``, this rank keeping its slice of ``dim`` (by
    default the sequence of [s, b, h]), into a new tensor: (that tensor, its Work). The tensor
    is a view of the transport's buffer, laid out with ``dim`` first, and valid after the wait."""
    # The transport scatters along the flat memory, i.e. along dim 0 (as _all_gather).
    front = x.movedim(dim, 0).contiguous()
    rows = divide(
        front.shape[0], group_size(group), f"dimension {dim} of a {tuple(x.shape)} tensor"
    )
    out = front.new_empty((rows, *front.shape[1:]))
    work = dist.reduce_scatter_tensor(out, front, group=group, async_op=True)
    return out.movedim(0, dim), work


# ---------------------------------------------------------------------------------------------
# Autograd functions: forward is one helper, backward its transpose.


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a new autograd node over the same memory

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """All-gather whose backward keeps this rank's slice: for consumers that are replicated
    (every rank computes the same thing from the gathered tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherReduceScatter(torch.autograd.Function):
    """All-gather whose backward reduce-scatters: for consumers that are tensor-parallel (each
    rank's gradient of the gathered tensor is a partial sum over the tensor-parallel split)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


# ---------------------------------------------------------------------------------------------
# Public wrappers. A group of one short-circuits: no autograd node, no communication.


def _alone(group: ProcessGroup | None) -> bool:
    return group_size(group) == 1


def copy_to_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enters a tensor-parallel region with a replicated input: identity forward, all-reduce of
    the gradient backward (each rank's gradient is a partial sum)."""
    return x if _alone(group) else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Leaves a tensor-parallel region by summing partial results: all-reduce forward,
    identity backward."""
    return x if _alone(group) else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Keeps this rank's slice of the last dimension; backward all-gathers the gradient."""
    return x if _alone(group) else _Split.apply(x, x.dim() - 1, group)


def gather_from_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gathers the last dimension; backward keeps this rank's slice of the gradient."""
    return x if _alone(group) else _Gather.apply(x, x.dim() - 1, group)


def scatter_to_sequence_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 0
) -> torch.Tensor:
    """Keeps this rank's slice of the sequence dimension; backward all-gathers the gradient."""
    return x if _alone(group) else _Split.apply(x, dim % x.dim(), group)


def gather_from_sequence_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 0, reduce_grad: bool = True
) -> torch.Tensor:
    """All-gathers the sequence dimension. With ``reduce_grad`` (the input of a
    tensor-parallel region, where each rank's gradient is a partial sum, as after
    copy_to_region) backward reduce-scatters the gradient; without it (a replicated consumer)
    backward keeps this rank's slice."""
    if _alone(group):
        return x
    gather = _GatherReduceScatter if reduce_grad else _Gather
    return gather.apply(x, dim % x.dim(), group)


def reduce_scatter_to_sequence_region(
    x: torch.Tensor, group: ProcessGroup | None, dim: int = 0
) -> torch.Tensor:
    """Leaves a tensor-parallel region by summing partial results and keeping this rank's slice
    of the sequence dimension; backward all-gathers the gradient."""
    return x if _alone(group) else _ReduceScatter.apply(x, dim % x.dim(), group)
