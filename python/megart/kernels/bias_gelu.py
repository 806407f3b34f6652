"""Bias add + GeLU (tanh approximation, as GPT-2) as one op: the MLP's first projection skips its
bias add and this applies bias and activation in one pass over memory.

``bias_gelu_reference`` and ``bias_gelu_backward_reference`` are the math in plain torch (fp32
arithmetic for 16-bit inputs, rounded once, as the CUDA kernel does); the CPU path uses them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from megart.errors import ConfigError
from megart.kernels._dispatch import common_dtype, compute_dtype, cuda_kernel, launch

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias), bias broadcast over the last dimension."""
    c = compute_dtype(x.dtype)
    return F.gelu(x.to(c) + bias.to(c), approximate="tanh").to(x.dtype)


def bias_gelu_backward_reference(
    grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of bias_gelu with respect to x and bias. The bias gradient sums the (rounded)
    x gradient over all rows, as the CUDA path does."""
    c = compute_dtype(x.dtype)
    z = x.to(c) + bias.to(c)
    t = torch.tanh(_SQRT_2_OVER_PI * (z + _CUBIC * z**3))
    slope = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _CUBIC * z * z)
    grad_x = (grad.to(c) * slope).to(x.dtype)
    # Rows counted explicitly: reshape(-1, 0) is ambiguous for an empty last dimension.
    rows = x.shape[:-1].numel()
    grad_bias = grad_x.reshape(rows, bias.numel()).sum(0, dtype=c).to(bias.dtype)
    return grad_x, grad_bias


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, bias)
        kernel = cuda_kernel("bias_gelu_forward", x, bias)
        if kernel is None or bias.numel() == 0:  # an empty bias: the kernel takes hidden >= 1
            return bias_gelu_reference(x, bias)
        out = torch.empty_like(x)
        launch(kernel, x, x, bias, out, x.numel(), bias.numel())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, bias = ctx.saved_tensors
        grad = grad.to(x.dtype).contiguous()
        kernel = cuda_kernel("bias_gelu_backward", grad, x, bias)
        if kernel is None or bias.numel() == 0:
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
