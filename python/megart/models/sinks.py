"""Attention sinks: Megatron-LM's --softmax-type (Megatron-Core's TransformerConfig.softmax_type,
as in gpt-oss): each softmax row normalised over its keys and one extra logit that reads no value.

"off-by-one" adds the logit 0 to every row (Evan Miller's softmax1): the weights of a row sum
to sigmoid(lse) < 1, so a head may attend to nothing. "learnable" adds one learned logit per
head, ``softmax_offset`` (Megatron-Core's DotProductAttention parameter of that name, length the
rank's heads: sharded over tensor parallelism like the heads, partition_dim 0; drawn N(0,
init_std) as Megatron-Core's init_method draws it, here the whole vector from the layer's seeded
generator and each rank its slice, so alike under every layout; one dimension, so no weight
decay, as Megatron-Core's rule for 1-D parameters; in the parameters' dtype).

How it enters the attention, on every path: given a block's output O and its rows' log-sum-exp
L over the keys, the sink's row is O' = O exp(L - L'), L' = logaddexp(L, sink). torch's
attention kernels that return L (megart.models.flash_blocks: the CPU's flash kernel, with or
without a bias; CUDA's flash kernel in fp16/bf16, its memory-efficient one with a bias or in
fp32) compute O and L; their backward, given O' and L', is the real keys' exact gradient
(the sink reads no value, so the softmax's backward term rowsum(dO' o O') is unchanged), and the
sink's gradient is -sum over rows of exp(sink - L') rowsum(dO' o O') (sink_grad). Where no such
kernel takes the queries (dropout on the CPU, float64 on CUDA, --attention-backend
unfused/local) the scores are explicit (explicit_attention: Megatron-Core's own local path,
the sink a column of the softmax). Sliding windows and documents' masks enter as the bias (the
window's query tiles are not used with a sink). The ring (megart.models.ring_attention) starts
each row's log-sum-exp at the sink instead of -inf (initial_lse), so that its log-sum-exp merge
counts the sink once; all_gather and a2a context parallelism call this module's attention on
their own keys (a2a with its heads' part of the sink).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from megart.models import flash_blocks


def sink_logits(
    kind: str, param: torch.Tensor | None, heads: int, like: torch.Tensor
) -> torch.Tensor | None:
    """The sink logit of each of ``heads`` heads for softmax type ``kind`` (None: vanilla)."""
    if kind == "off-by-one":
        return torch.zeros(heads, dtype=like.dtype, device=like.device)
    return param


def initial_lse(
    sink: torch.Tensor | None, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[b, heads, rows]: a log-sum-exp fold's start: -inf (nothing yet), or each head's sink,
    counted once, before any block of keys."""
    if sink is None:
        return torch.full(shape, float("-inf"), dtype=dtype, device=device)
    return sink.detach().to(dtype).view(1, -1, 1).expand(shape).clone()


def sink_grad(
    sink: torch.Tensor | None, lse: torch.Tensor, out: torch.Tensor, dout: torch.Tensor
) -> torch.Tensor | None:
    """The sink's gradient from its rows: -sum over batch and rows of exp(sink - lse)
    rowsum(dout o out), ``lse`` and ``out`` the rows' whole (sink included) ones."""
    if sink is None:
        return None
    c = lse.dtype
    delta = (dout.to(c) * out.to(c)).sum(-1)
    weight = torch.exp(sink.detach().to(c).view(1, -1, 1) - lse)
    return -(weight * delta).sum((0, 2)).to(sink.dtype)


def _kernels(q: torch.Tensor, dropout: float, bias: torch.Tensor | None) -> str | None:
    """Which of flash_blocks' kernels compute the block ("flash", "masked"), or None: under
    sdpa_kernel(MATH) (--attention-backend unfused/local) none, as for torch's attention."""
    cuda = torch.backends.cuda
    if not (cuda.flash_sdp_enabled() or cuda.mem_efficient_sdp_enabled()):
        return None
    if bias is None and flash_blocks.usable(q, dropout):
        return "flash"
    return "masked" if flash_blocks.masked_usable(q, dropout) else None


class SinkAttention(torch.autograd.Function):
    """softmax([q k^T / sqrt(d) + bias, sink]) v without the sink's column, by flash_blocks'
    kernels ``kind`` (see the module's docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sink: torch.Tensor,
        bias: torch.Tensor | None,
        causal: bool,
        dropout: float,
        kind: str,
    ) -> torch.Tensor:
        if kind == "flash":
            out, lse, saved = flash_blocks.forward(q, k, v, causal, dropout)
        else:
            out, lse, saved = flash_blocks.masked_forward(q, k, v, bias, causal, dropout)
        whole = torch.logaddexp(lse, sink.detach().to(lse.dtype).view(1, -1, 1))
        out = (out.to(lse.dtype) * torch.exp(lse - whole).unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, sink, out, whole)
        ctx.bias, ctx.causal, ctx.dropout, ctx.kind, ctx.saved = bias, causal, dropout, kind, saved
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, sink, out, whole = ctx.saved_tensors
        dout = dout.contiguous()
        common = (ctx.causal, ctx.dropout, ctx.saved)
        if ctx.kind == "flash":
            dq, dk, dv = flash_blocks.backward(dout, q, k, v, out, whole, *common)
        else:
            dq, dk, dv = flash_blocks.masked_backward(dout, q, k, v, out, whole, ctx.bias, *common)
        return dq, dk, dv, sink_grad(sink, whole, out, dout), None, None, None, None


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor,
    bias: torch.Tensor | None,
    dropout: float,
) -> torch.Tensor:
    """The same with explicit scores (at least fp32), the sink a last column of the softmax,
    dropped before dropout and the values (Megatron-Core's SoftmaxOne); causal without a
    ``bias``. Differentiated by autograd."""
    c = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(c) @ k.to(c).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if bias is None:
        later = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, -math.inf)
    else:
        s = s + bias.to(c)
    column = sink.to(c).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    p = F.dropout(p, dropout) if dropout else p
    return (p @ v.to(c)).to(q.dtype)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor,
    dropout: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with ``sink`` ([heads] logits) of q [b, heads, s, d] over k and v (repeated
    per query head): causal with no ``bias``, else under the additive ``bias`` alone."""
    kind = _kernels(q, dropout, bias)
    if kind is None:
        return explicit_attention(q, k, v, sink, bias, dropout)
    return SinkAttention.apply(q, k, v, sink, bias, bias is None, dropout, kind)
