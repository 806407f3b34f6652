"""The entry of a column-parallel region, whose backward collective runs while the weight
gradients of the products reading it are computed (as Megatron-LM's asynchronous
tensor-parallel backward: the all-reduce since 2021, the reduce-scatter with sequence
parallelism since 2022).

A column-parallel product y = x W^T has two backward products: dX = dY W, this rank's partial
sum of the input's gradient, which the entry then all-reduces (or, with sequence parallelism,
reduce-scatters over the sequence) across the tensor-parallel group; and dW = dY^T X, which
nothing in the backward waits for. In autograd's order the collective would start only after
both. Here each product that reads an entry leaves its dW in the entry's
:class:`WeightGradSlot`; the entry's backward starts its collective asynchronously, computes
those dWs while it is in flight, then waits for it. The same products and sums run, in another
order; only the time changes, the collective hidden behind the dWs where they take longer.

One entry may feed several products (SwiGLU's gate and up projections): autograd sums their
dX before it runs the entry's backward, so the one collective covers both, and both dWs overlap
it. Inside a zero-bubble schedule's I the dWs belong to its W (weight_grad.WeightGradStore), so
the slot stays empty and the entry waits at once. A product whose input needs no gradient has
no entry backward to run its dW, and computes it in its own backward as before.
"""

from __future__ import annotations

from typing import Any

import torch

from megart.distributed import ProcessGroup
from megart.tensor_parallel._group import group_size
from megart.tensor_parallel.mappings import _all_gather, start_all_reduce, start_reduce_scatter
from megart.tensor_parallel.weight_grad import accumulate


class WeightGradSlot:
    """The dWs an entry's backward computes: each product's kept (X, dY, (weight, bias)), and
    whether that product runs its parameters' hooks (weight_grad.accumulate)."""

    def __init__(self) -> None:
        self._kept: list[tuple[tuple, bool]] = []

    def keep(self, item: tuple, run_hooks: bool) -> None:
        self._kept.append((item, run_hooks))

    def run(self) -> None:
        """Computes and accumulates every kept dW, then forgets them."""
        kept, self._kept = self._kept, []
        for run_hooks in (True, False):  # one accumulate (one autograd call) for each
            items = [item for item, hooks in kept if hooks == run_hooks]
            if items:
                accumulate(items, run_hooks)

    def __len__(self) -> int:
        return len(self._kept)


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, sequence: bool, slot: WeightGradSlot
    ) -> torch.Tensor:
        ctx.group, ctx.sequence, ctx.slot = group, sequence, slot
        # A new autograd node over the same memory, or the sequence gathered over the group.
        return _all_gather(x, 0, group) if sequence else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        start = start_reduce_scatter if ctx.sequence else start_all_reduce
        summed, work = start(grad, ctx.group)
        ctx.slot.run()  # while the collective is in flight
        work.wait()
        return summed, None, None, None


def enter_column_region(
    x: torch.Tensor, group: ProcessGroup | None, sequence_parallel: bool
) -> tuple[torch.Tensor, WeightGradSlot | None]:
    """The input of column-parallel products as they multiply it (the same tensor, or with
    ``sequence_parallel`` this rank's slice of dimension 0 gathered over ``group``), and the
    slot those products leave their dW in (weight_grad.linear's ``slot``); None alone, where
    there is no collective to overlap.

    Under autocast the input enters in its 16-bit type, which the products would each cast it
    to: an fp32 residual stream's norm output (--fp32-residual-connection) then gives SwiGLU's
    gate and up one saved 16-bit copy, not one each, and sequence parallelism gathers (and its
    backward reduce-scatters) 16-bit elements, as with a 16-bit stream: for every column-parallel
    entry, the tied output layer's included."""
    device = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(device):
        x = x.to(torch.get_autocast_dtype(device))
    if group_size(group) == 1:
        return x, None
    slot = WeightGradSlot()
    return _Enter.apply(x, group, sequence_parallel, slot), slot


def enter_again(
    x: torch.Tensor, dtype: torch.dtype, group: ProcessGroup | None, sequence: bool
) -> torch.Tensor:
    """What :func:`enter_column_region` made of ``x`` (its autocast copy in ``dtype``, the
    sequence gathered), made again without autograd: to refill an entered copy whose memory
    was freed (megart.models.dropped_output)."""
    with torch.no_grad():
        x = x.to(dtype)
        return _all_gather(x, 0, group) if sequence and group_size(group) > 1 else x
