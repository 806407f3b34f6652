"""One block of ring attention by torch's flash attention kernels (CUDA's, or the CPU one).

The ring (megart.models.ring_attention) needs of each block its output and the log-sum-exp of its
rows, to fold the blocks into the whole attention; torch's flash forward returns both. Each
block's backward is the flash backward given the whole attention's output and log-sum-exp
rather than the block's own: the kernel then takes its softmax term, rowsum(dO o O), from the
folded output and exponentiates the scores against the folded normaliser, which makes its dq,
dk, dv exactly the block's share of the whole attention's gradients.

Both kernels are private torch operators (aten._scaled_dot_product_flash_attention and
_for_cpu); torch's own context parallelism (torch.distributed.tensor.experimental) calls them
the same way. On CUDA they take fp16 and bf16 with head dimensions that are multiples of 8 up
to 256, with dropout (its random state returned by the forward and handed to the backward);
the CPU kernel takes every floating type and no dropout. Elsewhere the ring computes its blocks
with explicit products (``usable``).

A block under a mask (a sliding window's pieces, megart.models.ring_window) is computed by the
kernels that take an additive bias and return the log-sum-exp (``masked_forward`` and
``masked_backward``, same contract): on the CPU the same flash kernel, given ``attn_mask``; on
CUDA the memory-efficient kernel (aten._scaled_dot_product_efficient_attention), which takes
fp16, bf16 and fp32 (its sources carry fp32 kernels for every architecture from sm50) and
dropout, and a bias of the queries' dtype, 4-dimensional, its rows' stride a multiple of 16
bytes (megart.models.window_masks.additive_bias aligns them). Its backward reads the
log-sum-exp in rows of 32 (LSE_ROWS), the padding +inf as its forward writes it; the folded
log-sum-exp is padded so. Both kernels return a row whose keys are all masked with log-sum-exp
0 (not -inf) and output 0: callers pass no such row (the ring's pieces have none). The CUDA
branch is unverified on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

CUDA_DTYPES = (torch.float16, torch.bfloat16)
MASKED_CUDA_DTYPES = (*CUDA_DTYPES, torch.float32)
LSE_ROWS = 32  # the memory-efficient backward reads the log-sum-exp in blocks of as many rows


def usable(q: torch.Tensor, dropout: float) -> bool:
    """Whether the flash kernels take this block's queries (and dropout)."""
    if q.is_cuda:
        d = q.shape[-1]
        return q.dtype in CUDA_DTYPES and d % 8 == 0 and d <= 256
    return q.device.type == "cpu" and not dropout


def masked_usable(q: torch.Tensor, dropout: float) -> bool:
    """Whether the masked kernels take this block's queries (and dropout): on CUDA fp16, bf16
    and fp32 with head dimensions that are multiples of 8 (the memory-efficient kernel's
    aligned loads), with dropout; on the CPU every floating type without dropout."""
    if q.is_cuda:
        return q.dtype in MASKED_CUDA_DTYPES and q.shape[-1] % 8 == 0
    return q.device.type == "cpu" and not dropout


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    dropout: float,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The block's attention (q's type), its rows' log-sum-exp (fp32; float64 for float64 on
    the CPU), and what its backward needs of this call (CUDA: sequence bounds, random state).
    ``causal``: key j masked for row i when j > i (a square block's top left). ``scale``: the
    scores' factor (None: 1/sqrt of the width)."""
    if q.is_cuda:
        out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout, causal, scale=scale
        )
        return out, lse, rest[:6]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse, None


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    dropout: float,
    saved: Any,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of dq, dk, dv, given the whole attention's ``out`` and ``lse`` for the
    block's rows and ``saved``, what ``forward`` returned for it (and its ``scale``)."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cum_q,
            cum_k,
            max_q,
            max_k,
            dropout,
            causal,
            seed,
            offset,
            scale=scale,
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _bias4(bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[rows, keys] as the memory-efficient kernel takes it: [b, heads, rows, keys] (a view)."""
    return None if bias is None else bias.expand(*q.shape[:3], k.shape[2])


def masked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    dropout: float,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """As ``forward``, with ``bias`` ([rows, keys], q's dtype, 0 or -inf; None: none) added to
    the scores. Every row must have a key the bias allows (see the module's docstring)."""
    if q.is_cuda:
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, _bias4(bias, q, k), True, dropout, causal
        )
        return out, lse[..., : q.shape[2]], (seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias
    )
    return out, lse, None


def masked_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    dropout: float,
    saved: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``backward``, for ``masked_forward``'s block with the same ``bias``."""
    if q.is_cuda:
        seed, offset = saved
        b, h, rows = lse.shape
        height = -(-rows // LSE_ROWS) * LSE_ROWS
        padded = torch.full((b, h, height), float("inf"), dtype=lse.dtype, device=lse.device)
        padded[..., :rows] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, _bias4(bias, q, k), out, padded, seed, offset, dropout,
            [True, True, True, False], causal,
        )  # fmt: skip
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias
    )
