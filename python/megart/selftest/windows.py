"""Sliding-window attention (--window-size) on this device, as a windowed layer runs it
(megart.models.window.sequence_attention): in query tiles each over the keys its windows
reach (megart.models.window_tiles) when the window is much shorter than the sequence, through
one explicit s x s mask otherwise; output and gradients against the definition (each query
attends to itself and the ``left`` tokens before it) in float64 on the CPU.

On a GPU this is the path the CPU suite cannot run: SDPA with a mask there is the
memory-efficient kernel, which takes the cached additive bias (megart.models.window_masks,
its rows padded to 16 elements; a tile's keys, T + left, are rarely a multiple)."""

from __future__ import annotations

import torch

from megart.models.window import sequence_attention
from megart.models.window_tiles import band_tile
from megart.selftest.report import Check, judged, relative_error
from megart.selftest.ring_blocks import TOLERANCE

# (sequence, left): tiled (1024 >= 2 (256 + 100)), and one mask (left too long to tile).
CASES = ((1024, 100), (512, 300))


def definition(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, left: int
) -> list[torch.Tensor]:
    """float64 on the CPU: softmax over keys j with i - left <= j <= i, written out."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~((j <= i) & (j >= i - left)), float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    y.backward(dout.double().cpu())
    return [y, q.grad, k.grad, v.grad]


def windowed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, left: int
) -> list[torch.Tensor]:
    """megart's windowed attention on the inputs' device and dtype: [out, dq, dk, dv]."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    y = sequence_attention(q, k, v, 0.0, window=left)
    y.backward(dout)
    return [y, q.grad, k.grad, v.grad]


def check_sliding_window(device: torch.device) -> list[Check]:
    """On CUDA in bf16 and fp16, on the CPU in fp32; each CASES entry."""
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)
    checks = []
    for dtype in dtypes:
        for seq, left in CASES:
            g = torch.Generator().manual_seed(seq + left)
            q, k, v, dout = (torch.randn(1, 4, seq, 64, generator=g, dtype=torch.float64)
                             for _ in "qkvo")  # fmt: skip
            inputs = [t.to(device, dtype) for t in (q, k, v, dout)]
            err = max(
                relative_error(got, want)
                for got, want in zip(
                    windowed(*inputs, left), definition(*inputs, left), strict=True
                )  # fmt: skip
            )
            how = "query tiles" if band_tile(seq, left) is not None else "one s x s mask"
            name = f"sliding window {how} {str(dtype).removeprefix('torch.')}"
            what = f"on {device.type}, s {seq}, window {left}, output and gradients vs float64, "
            checks.append(judged(name, err, TOLERANCE[dtype], what=what))
    return checks
