"""Attention sinks (--softmax-type, megart.models.sinks) on this device, as a layer runs them
(sink_attention): causal, and under a sliding window's bias; output and the gradients of q, k,
v and the sink against the definition (each row's softmax over its keys and the sink's logit,
the sink's share dropped) in float64 on the CPU.

On a GPU this is the path the CPU suite cannot run: the flash kernel's output and log-sum-exp
in bf16 and fp16, the memory-efficient kernel's with the window's bias and in fp32, each
rescaled by the sink, and their backward given the rescaled output and log-sum-exp."""

from __future__ import annotations

import torch

from megart.models.sinks import sink_attention
from megart.models.window_masks import sliding_causal_bias
from megart.selftest.report import Check, judged, relative_error
from megart.selftest.ring_blocks import TOLERANCE

CASES = ((512, None), (512, 100))  # (sequence, window: earlier tokens seen; None: causal)


def definition(inputs: list[torch.Tensor], left: int | None) -> list[torch.Tensor]:
    """float64 on the CPU, written out, of ``inputs`` [q, k, v, sink, dout]: [out, dq, dk, dv,
    dsink]."""
    q, k, v, sink = (t.detach().double().cpu().requires_grad_() for t in inputs[:4])
    dout = inputs[4]
    s = q.shape[2]
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    seen = (j <= i) & ((j >= i - left) if left is not None else True)
    scores = ((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).masked_fill(~seen, float("-inf"))
    column = sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    y = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ v
    y.backward(dout.double().cpu())
    return [y, q.grad, k.grad, v.grad, sink.grad]


def with_sink(inputs: list[torch.Tensor], left: int | None) -> list[torch.Tensor]:
    """megart's attention with a sink on the inputs' device and dtype (the sink in fp32, as
    the parameter is), of ``inputs`` [q, k, v, sink, dout]: [out, dq, dk, dv, dsink]."""
    q, k, v, sink = (t.detach().clone().requires_grad_() for t in inputs[:4])
    dout = inputs[4]
    bias = None if left is None else sliding_causal_bias(q.shape[2], left, q.dtype, q.device)
    y = sink_attention(q, k, v, sink, 0.0, bias)
    y.backward(dout)
    return [y, q.grad, k.grad, v.grad, sink.grad]


def check_sinks(device: torch.device) -> list[Check]:
    """On CUDA in bf16, fp16 and fp32, on the CPU in fp32; each CASES entry."""
    cuda = device.type == "cuda"
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if cuda else (torch.float32,)
    checks = []
    for dtype in dtypes:
        for seq, left in CASES:
            g = torch.Generator().manual_seed(seq + (left or 0))
            q, k, v, dout = (torch.randn(2, 4, seq, 64, generator=g, dtype=torch.float64)
                             for _ in "qkvo")  # fmt: skip
            sink = torch.randn(4, generator=g, dtype=torch.float64) + 2.0  # a sink that weighs
            inputs = [t.to(device, dtype) for t in (q, k, v)]
            args = [*inputs, sink.to(device, torch.float32), dout.to(device, dtype)]
            err = max(
                relative_error(got, want)
                for got, want in zip(with_sink(args, left), definition(args, left), strict=True)
            )
            how = "causal" if left is None else f"window {left}"
            name = f"attention sink {how} {str(dtype).removeprefix('torch.')}"
            what = f"on {device.type}, s {seq}, output and gradients (the sink's too) vs float64, "
            checks.append(judged(name, err, TOLERANCE[dtype], what=what))
    return checks
