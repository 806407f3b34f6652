"""LayerNorm with the residual add folded in: ``out = layer_norm(x + residual)``, also returning
the sum, which is the next residual. The unfused form writes the sum and reads it back; the
fused kernel does both in one pass over the row.

The references are plain torch (fp32 arithmetic for 16-bit inputs): the forward is exactly
``F.layer_norm(x + residual)``, the backward the closed form the CUDA kernel implements.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from megart.errors import ConfigError
from megart.kernels._dispatch import common_dtype, compute_dtype, cuda_kernel, dtype_name, launch


def add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(s), s) with s = x + residual (x itself without a residual), over the last
    dimension. The sum is rounded to the input dtype before it is normalised, as the unfused
    add then LayerNorm would."""
    s = x if residual is None else x + residual
    c = compute_dtype(s.dtype)
    b = None if bias is None else bias.to(c)
    out = F.layer_norm(s.to(c), (s.shape[-1],), weight.to(c), b, eps)
    return out.to(s.dtype), s


def add_layer_norm_backward_reference(
    grad_out: torch.Tensor,
    grad_sum: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor,
    has_bias: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients with respect to the sum s (plus grad_sum, what reached s through the residual
    stream), the weight and the bias, from the forward's input s:
    d s = rstd (g - mean(g) - xhat mean(g xhat)), g = grad_out * weight."""
    c = compute_dtype(s.dtype)
    h = s.shape[-1]
    s32 = s.to(c)
    mean = s32.mean(-1, keepdim=True)
    rstd = torch.rsqrt((s32 - mean).pow(2).mean(-1, keepdim=True) + eps)
    xhat = (s32 - mean) * rstd
    dy = grad_out.to(c)
    g = dy * weight.to(c)
    grad_s = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if grad_sum is not None:
        grad_s = grad_s + grad_sum.to(c)
    grad_weight = (dy * xhat).reshape(-1, h).sum(0).to(weight.dtype)
    grad_bias = dy.reshape(-1, h).sum(0).to(weight.dtype) if has_bias else None
    return grad_s.to(s.dtype), grad_weight, grad_bias


class _AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an unused sum sends None, not a tensor of zeros
        ctx.eps, ctx.has_residual, ctx.has_bias = eps, residual is not None, bias is not None
        present = [t for t in (x, residual, weight, bias) if t is not None]
        kernel = cuda_kernel("add_layer_norm_forward", *present)
        if kernel is None:
            out, s = add_layer_norm_reference(x, residual, weight, bias, eps)
            ctx.save_for_backward(s, weight, None, None)
        else:
            h = x.shape[-1]
            rows = x.numel() // h
            out = torch.empty_like(x)
            s = x if residual is None else torch.empty_like(x)
            mean = torch.empty(rows, dtype=torch.float32, device=x.device)
            rstd = torch.empty_like(mean)
            sum_out = None if residual is None else s
            launch(kernel, x, x, residual, weight, bias, out, sum_out, mean, rstd, rows, h, eps)
            ctx.save_for_backward(s, weight, mean, rstd)
        return (out, s) if residual is not None else out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, *rest: torch.Tensor | None) -> tuple:
        s, weight, mean, rstd = ctx.saved_tensors
        grad_sum = rest[0] if rest else None
        if grad_out is None:
            grad_out = torch.zeros_like(s)
        grad_out = grad_out.to(s.dtype).contiguous()
        if grad_sum is not None:
            grad_sum = grad_sum.to(s.dtype).contiguous()
        grads = None
        if mean is not None:
            grads = _backward_kernel(grad_out, grad_sum, s, weight, mean, rstd, ctx.has_bias)
        if grads is None:
            grads = add_layer_norm_backward_reference(
                grad_out, grad_sum, s, weight, ctx.has_bias, ctx.eps
            )
        grad_s, grad_weight, grad_bias = grads
        # d out / d x = d out / d residual = d out / d s.
        return grad_s, grad_s if ctx.has_residual else None, grad_weight, grad_bias, None


def _backward_kernel(
    grad_out: torch.Tensor,
    grad_sum: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The CUDA backward, or None when the kernel is missing or a block's per-column
    accumulators for this hidden size do not fit the GPU's shared memory (the reference runs).
    One launch call gives every gradient: its second kernel sums the blocks' partial weight and
    bias gradients and rounds them to the weight's dtype."""
    kernel = cuda_kernel("add_layer_norm_backward", grad_out, s, weight)
    if kernel is None:
        return None
    h = s.shape[-1]
    rows = s.numel() // h
    blocks = _backward_blocks(s.device.index, rows, h, has_bias, dtype_name(s))
    if blocks == 0:
        return None
    grad_s = torch.empty_like(s)
    grad_weight = torch.empty_like(weight)
    grad_bias = torch.empty_like(weight) if has_bias else None
    workspace = torch.empty((2 if has_bias else 1) * blocks * h, device=s.device)
    tensors = (grad_out, grad_sum, s, weight, mean, rstd, grad_s, grad_weight, grad_bias)
    launch(kernel, s, *tensors, workspace, rows, h, blocks)
    return grad_s, grad_weight, grad_bias


@functools.lru_cache(maxsize=256)
def _backward_blocks(device: int, rows: int, hidden: int, has_bias: bool, dtype: str) -> int:
    """The backward's block count on ``device``, asked once per shape: a micro-batch's shapes
    repeat every step."""
    from megart import _cuda

    with torch.cuda.device(device):
        return _cuda.add_layer_norm_backward_blocks(rows, hidden, has_bias, dtype)


def _prepare(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> list[torch.Tensor | None]:
    h = x.shape[-1] if x.dim() else 0
    if h == 0 or weight.shape != (h,) or (bias is not None and bias.shape != (h,)):
        raise ConfigError(
            f"layer_norm: weight {tuple(weight.shape)} and bias "
            f"{None if bias is None else tuple(bias.shape)} must both be [{h}], the last "
            f"dimension of x {tuple(x.shape)}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ConfigError(
            f"add_layer_norm: residual {tuple(residual.shape)} must have the shape of x "
            f"{tuple(x.shape)}"
        )
    if not eps > 0:
        raise ConfigError(f"layer_norm: eps must be positive, not {eps}")
    tensors = (x, residual, weight, bias)
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ConfigError(f"layer_norm: inputs on several devices {sorted(map(str, devices))}")
    dtype = common_dtype("layer_norm", *tensors)
    return [None if t is None else t.to(dtype).contiguous() for t in tensors]


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.layer_norm(x + residual, ...), x + residual)`` over the last dimension: megart's
    CUDA kernel for GPU tensors in fp32/bf16/fp16, the torch reference otherwise. Inputs of
    different dtypes are computed in torch's promoted dtype."""
    x, residual, weight, bias = _prepare(x, residual, weight, bias, eps)
    return _AddLayerNorm.apply(x, residual, weight, bias, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``F.layer_norm`` over the last dimension through the same kernel, without a residual."""
    x, _, weight, bias = _prepare(x, None, weight, bias, eps)
    return _AddLayerNorm.apply(x, None, weight, bias, eps)
