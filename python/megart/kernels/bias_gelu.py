"""Bias add + GeLU (tanh approximation, as GPT-2) as one op: the MLP's first projection skips its
bias add and this applies bias and activation in one pass over memory.

``bias_gelu_reference`` and ``bias_gelu_backward_reference`` are the math in plain torch (fp32
arithmetic for 16-bit inputs, rounded once, as the CUDA kernel does); the CPU path computes
them. ``megart train`` fuses by default (as Megatron-LM's --bias-gelu-fusion), so that path
costs what the unfused ops cost: the bias add, torch's ``gelu`` and, backward, torch's own
``gelu_backward`` (F.gelu's derivative, one pass) and the bias's column sum, the ops autograd
runs for ``F.gelu(F.linear(x, w, b))``; in fp32 and fp64 its results are theirs bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megart.errors import ConfigError
from megart.kernels._dispatch import common_dtype, compute_dtype, cuda_kernel, launch


def _biased(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + bias in the compute dtype: GeLU's input."""
    c = compute_dtype(x.dtype)
    return x.to(c) + bias.to(c)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias), bias broadcast over the last dimension."""
    return F.gelu(_biased(x, bias), approximate="tanh").to(x.dtype)


def bias_gelu_backward_reference(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of bias_gelu with respect to x and bias. The bias gradient sums the (rounded)
    x gradient over all rows, as the CUDA path does."""
    return _backward(grad, _biased(x, bias), x.dtype, bias)


def _backward(
    grad: torch.Tensor, z: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients at GeLU's input ``z`` (x + bias, in the compute dtype): torch's
    gelu_backward, the derivative autograd takes for F.gelu, 0.5 (1 + t) + 0.5 z (1 - t^2)
    sqrt(2/pi) (1 + 3 0.044715 z^2) with t = tanh(sqrt(2/pi) (z + 0.044715 z^3)), in one pass."""
    grad_x = torch.ops.aten.gelu_backward(grad.to(z.dtype), z, approximate="tanh").to(dtype)
    # Rows counted explicitly: reshape(-1, 0) is ambiguous for an empty last dimension.
    rows = z.shape[:-1].numel()
    grad_bias = grad_x.reshape(rows, bias.numel()).sum(0, dtype=z.dtype).to(bias.dtype)
    return grad_x, grad_bias


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        kernel = cuda_kernel("bias_gelu_forward", x, bias)
        ctx.kernel = kernel is not None and bias.numel() > 0  # the kernel takes hidden >= 1
        if not ctx.kernel:
            # torch's ops; backward needs GeLU's input, kept as F.gelu's autograd keeps it
            # (recomputed from x where it is in fp32 for a 16-bit x, twice x's memory).
            z = _biased(x, bias)
            ctx.keeps_z = z.dtype == x.dtype
            ctx.save_for_backward(z if ctx.keeps_z else x, bias)
            return F.gelu(z, approximate="tanh").to(x.dtype)
        ctx.save_for_backward(x, bias)
        out = torch.empty_like(x)
        launch(kernel, x, x, bias, out, x.numel(), bias.numel())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, bias = ctx.saved_tensors
        if not ctx.kernel:  # x is z where kept, in x's dtype
            return _backward(grad, x if ctx.keeps_z else _biased(x, bias), x.dtype, bias)
        grad = grad.to(x.dtype).contiguous()
        kernel = cuda_kernel("bias_gelu_backward", grad, x, bias)
        if kernel is None:
            return bias_gelu_backward_reference(grad, x, bias)
        grad_x = torch.empty_like(x)
        launch(kernel, x, grad, x, bias, grad_x, x.numel(), bias.numel())
        # A column sum: torch's reduction kernel, accumulating in fp32.
        grad_bias = grad_x.view(-1, bias.numel()).sum(0, dtype=torch.float32).to(bias.dtype)
        return grad_x, grad_bias


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) for x ``[..., h]`` and bias ``[h]``: megart's CUDA kernel for GPU
    tensors in fp32/bf16/fp16, the torch reference otherwise. Inputs of different dtypes are
    computed in torch's promoted dtype, as ``F.gelu(x + bias)`` would be."""
    if bias.dim() != 1 or x.dim() < 1 or x.shape[-1] != bias.numel():
        raise ConfigError(
            f"bias_gelu: bias {tuple(bias.shape)} must be 1-D with as many entries as the last "
            f"dimension of x {tuple(x.shape)}"
        )
    if x.device != bias.device:
        raise ConfigError(f"bias_gelu: x is on {x.device} but bias on {bias.device}")
    dtype = common_dtype("bias_gelu", x, bias)
    return _BiasGeLU.apply(x.to(dtype).contiguous(), bias.to(dtype).contiguous())
