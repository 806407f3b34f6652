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
"""

from __future__ import annotations

from typing import Any

import torch

CUDA_DTYPES = (torch.float16, torch.bfloat16)


def usable(q: torch.Tensor, dropout: float) -> bool:
    """Whether the flash kernels take this block's queries (and dropout)."""
    if q.is_cuda:
        d = q.shape[-1]
        return q.dtype in CUDA_DTYPES and d % 8 == 0 and d <= 256
    return q.device.type == "cpu" and not dropout


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout: float
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The block's attention (q's type), its rows' log-sum-exp (fp32; float64 for float64 on
    the CPU), and what its backward needs of this call (CUDA: sequence bounds, random state).
    ``causal``: key j masked for row i when j > i (a square block's top left)."""
    if q.is_cuda:
        out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout, causal
        )
        return out, lse, rest[:6]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of dq, dk, dv, given the whole attention's ``out`` and ``lse`` for the
    block's rows and ``saved``, what ``forward`` returned for it."""
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, seed, offset
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal
    )
