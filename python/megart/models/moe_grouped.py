"""--moe-grouped-gemm: an MoE layer's (local) experts run as one grouped matrix product per
projection (Megatron-Core's GroupedMLP and TEGroupedMLP) over their tokens sorted by expert,
in place of one product per expert (SequentialMLP, models.moe's loop).

The experts stay models.mlp.MLP modules with their own parameters, names and attributes
(``experts.E.fc.weight`` ...; ``expert_parallel``, ``partition_dim``), so checkpoints, optimizer
states, expert resharding and the gradient buffers see the same parameters either way, and the
initial weights are the same (each expert's from its own stream). :func:`pack` puts each
projection's weights of the layer's experts into one stacked tensor, each parameter a view of
its slice (Megatron's GroupedMLP holds one [E, ...] parameter; megart keeps the per-expert
parameters over the stacked memory instead, because the optimizer's per-parameter state and
every checkpoint format are per expert): the product reads the stack as one [E, out, in]
tensor with no copy. Where something has moved the parameters apart since (--half-weights'
casts, the distributed optimizer's buffers in an order that is not an even stride) the stack
is gathered anew for each product: the same numbers, one copy.

The grouped product is torch._grouped_mm where torch computes it (see :func:`native`), else a
loop over the experts' slices; both compute each expert's rows times its own weight, so the
math is the same. Gradients: the input's by the grouped product with the weights, each
expert's weight gradient by the grouped product of the output gradient's and input's rows
(one [E, out, in] result whose slices go to the experts' parameters through autograd); inside
gradient accumulation fusion (megart train's default) each expert's weight gradient is added
into its fp32 gradient by the same fused product as without the flag. A zero-bubble schedule's
W does not take these weight gradients: they are computed in its I.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from megart.tensor_parallel import weight_grad
from megart.tensor_parallel.column_entry import enter_column_region


def pack(experts: Sequence[nn.Module]) -> None:
    """Each projection's weights of ``experts`` (MLPs) moved into one stacked tensor, each
    parameter a view of its slice (same values, names and attributes)."""
    for name in ("fc", "gate", "proj"):
        if getattr(experts[0], name, None) is None:
            continue
        params = [getattr(m, name).weight for m in experts]
        stacked = torch.empty(
            (len(params), *params[0].shape), dtype=params[0].dtype, device=params[0].device
        )
        with torch.no_grad():
            for e, p in enumerate(params):
                stacked[e].copy_(p)
                p.data = stacked[e]


def stacked(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weights ``params`` (each [out, in]) as one [E, out, in] tensor, without autograd:
    a view where they lie at an even stride in one storage (as :func:`pack` leaves them), else
    a copy."""
    first = params[0]
    step = params[1].storage_offset() - first.storage_offset() if len(params) > 1 else 0
    step = step if len(params) > 1 else first.numel()
    storage = first.untyped_storage().data_ptr()
    even = step >= first.numel() and all(
        p.is_contiguous()
        and p.shape == first.shape
        and p.dtype == first.dtype
        and p.untyped_storage().data_ptr() == storage
        and p.storage_offset() == first.storage_offset() + e * step
        for e, p in enumerate(params)
    )
    if even:
        size = (len(params), *first.shape)
        return first.detach().as_strided(size, (step, *first.stride()), first.storage_offset())
    return torch.stack([p.detach() for p in params])  # moved apart since pack: one copy


def native(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch._grouped_mm computes a grouped product of ``a`` and ``b`` (its operands,
    2-D or 3-D): it takes fp32, bf16 and fp16 (float64 it refuses), equal types, and each
    operand's leading stride (the one that is not 1) a multiple of 16 bytes; on CUDA it runs
    its own kernels on sm90/sm100 in bf16 and loops over the groups otherwise. Elsewhere
    :func:`grouped_mm`'s loop computes the same products."""
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if a.device.type not in ("cpu", "cuda"):
        return False
    align = 16 // a.element_size()
    for m in (a, b):
        inner = m.stride()[-2:]
        if 1 not in inner or max(inner) % align:
            return False
    return True


def grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Grouped product over groups of ``counts`` rows: ``a`` [M, k] with ``b`` [G, k, n] gives
    [M, n], group g's rows of ``a`` times ``b[g]``; ``a`` [k, M] with ``b`` [M, n] (both split
    along M) gives [G, k, n], group g's columns of ``a`` times its rows of ``b``."""
    if native(a, b):
        offs = torch.tensor(counts, dtype=torch.int32, device=a.device).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(a, b, offs=offs)
    if b.dim() == 3:
        return torch.cat([x @ w for x, w in zip(a.split(counts), b, strict=True)])
    pieces = zip(a.split(counts, dim=1), b.split(counts), strict=True)
    return torch.stack([x @ y for x, y in pieces])


class _GroupedLinear(torch.autograd.Function):
    """y = x W_g^T for each group g of ``counts`` rows of x, W_g the g-th of ``params``; under
    autocast in its type, as F.linear. The parameters' gradients are the slices of one grouped
    product."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, counts: list[int], *params: torch.Tensor
    ) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        xc = x.to(dtype)
        with torch.autocast(device, enabled=False):
            y = grouped_mm(xc, stacked(params).to(dtype).transpose(1, 2), counts)
        ctx.save_for_backward(xc, *params)
        ctx.counts, ctx.x_dtype = counts, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xc, *params = ctx.saved_tensors
        dy = dy.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            w = stacked(params).to(dy.dtype)
            dx = grouped_mm(dy, w, ctx.counts).to(ctx.x_dtype)
        if weight_grad.fusing() and all(weight_grad.grad_of(p) is not None for p in params):
            # Gradient accumulation fusion: each expert's dW added into its fp32 gradient by
            # the fused product the per-expert path uses (torch has no grouped product with an
            # fp32 output from 16-bit inputs on CPU, and a product then an add rounds
            # otherwise): the flag leaves a --bf16 curve where it was.
            pieces = zip(xc.split(ctx.counts), dy.split(ctx.counts), params, strict=True)
            weight_grad.accumulate([(x, g, (p, None)) for x, g, p in pieces])
            return dx, None, *(None for _ in params)
        dw = grouped_mm(dy.t(), xc, ctx.counts)
        return dx, None, *(g.to(p.dtype) for g, p in zip(dw, params, strict=True))


def grouped_linear(
    x: torch.Tensor, counts: list[int], weights: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The rows of ``x`` [M, in], in groups of ``counts``, each group times its weight's
    transpose (``weights``: [out, in] each): [M, out]."""
    return _GroupedLinear.apply(x, counts, *weights)


def grouped_experts(
    experts: Sequence[nn.Module], x: torch.Tensor, counts: list[int], scale: torch.Tensor
) -> torch.Tensor:
    """The experts (MLPs with ``expert``) on their rows of ``x`` [M, h] (sorted by expert,
    ``counts`` each), the activation times ``scale`` [M] (the routing weights): each row's
    expert's output, this rank's partial sum under tensor parallelism as MLP's."""
    first = experts[0]
    x, _ = enter_column_region(x, None, False)  # autocast's cast alone, as MLP's expert

    def weights(name: str) -> list[torch.Tensor]:
        return [getattr(m, name).weight for m in experts]

    up = grouped_linear(x, counts, weights("fc"))
    gate = grouped_linear(x, counts, weights("gate")) if first.swiglu else None
    y = first.scaled(first.act(up, gate), scale)
    return grouped_linear(y, counts, weights("proj"))
