"""The norms of a GPT layer: LayerNorm and RMSNorm, with Megatron's zero-centred weights as an
option, and how 16-bit inputs are normalised."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from megart.kernels import layer_norm
from megart.models.config import GPTConfig


def gamma(module: nn.Module) -> torch.Tensor:
    """The scale a norm multiplies by: its weight, or 1 + weight when the weight is stored
    zero-centred (Megatron's --apply-layernorm-1p)."""
    return module.weight + 1 if getattr(module, "zero_centered_gamma", False) else module.weight


HALF = (torch.bfloat16, torch.float16)


def in_dtype(dtype: torch.dtype, *params: torch.Tensor | None) -> list[torch.Tensor | None]:
    """A norm's weights in its input's ``dtype``: 16-bit for a 16-bit residual stream (as
    Megatron-LM's 16-bit weights give it; the gradient reaches fp32 weights through the cast,
    rounded to 16 bits as Megatron's is), fp32 for an fp32 stream over 16-bit weights
    (--half-weights with --fp32-residual-connection); weights already in it unchanged."""
    return [p if p is None or p.dtype == dtype else p.to(dtype) for p in params]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered_gamma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        # Either way the initial scale is 1.
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered_gamma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # 16-bit inputs are normalised in fp32 (as Megatron's and Hugging Face's RMSNorm do),
        # then scaled in their own dtype; float64 stays float64.
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return normed * in_dtype(x.dtype, gamma(self))[0]


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (weight and zero-initialised bias), with the option of a zero-centred
    weight: stored as scale - 1, so that the initial weight is zero (as Megatron's
    --apply-layernorm-1p); the bias is unchanged.

    A 16-bit input is normalised in its own dtype (fp32 arithmetic inside, the output and the
    input saved for backward 16-bit), with autocast off: CUDA's autocast would run LayerNorm on
    an fp32 copy of the input and keep that copy."""

    def __init__(self, dim: int, eps: float, zero_centered_gamma: bool) -> None:
        super().__init__(dim, eps=eps, bias=True)
        self.zero_centered_gamma = zero_centered_gamma
        if zero_centered_gamma:
            with torch.no_grad():
                self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = in_dtype(x.dtype, gamma(self), self.bias)
        own = torch.autocast(x.device.type, enabled=False) if x.dtype in HALF else nullcontext()
        with own:
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def norm(cfg: GPTConfig, sequence_parallel: bool, size: int | None = None) -> nn.Module:
    """A LayerNorm or RMSNorm over ``size`` channels (default the hidden size). A LayerNorm
    has its bias whatever --disable-bias-linear says: as in Megatron-Core, that flag removes
    the linear layers' biases only (add_bias_linear), and every LayerNorm it builds (the
    layers' input and pre-MLP norms, the final norm, --qk-layernorm's) has weight and bias.
    Under sequence parallelism each rank normalises its own slice of the sequence, so the
    weights' and bias's gradients are partial sums, marked for a sum across t."""
    centred, size = cfg.apply_layernorm_1p, size or cfg.hidden_size
    if cfg.normalization == "rmsnorm":
        module: nn.Module = RMSNorm(size, cfg.layernorm_epsilon, centred)
    else:
        module = LayerNorm(size, cfg.layernorm_epsilon, centred)
    for p in module.parameters():
        p.sequence_parallel = sequence_parallel
    return module


def apply_norm(module: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``module(x)``; with ``fused`` a LayerNorm runs through megart.kernels.layer_norm."""
    if fused and isinstance(module, nn.LayerNorm):
        # The kernel takes the scale itself; autograd carries its gradient to a zero-centred
        # weight unchanged (d(1 + w)/dw = 1).
        return layer_norm(x, *in_dtype(x.dtype, gamma(module), module.bias), module.eps)
    return module(x)
