"""The ring's flash blocks (--cp-comm-type p2p, megart.models.flash_blocks) on this device: one
rank's queries over two blocks of keys (the first causal, as a ring's own block is; the second
seen whole, as an earlier rank's), each block by the flash kernels, folded by log-sum-exp, and
each block's backward given the folded output and log-sum-exp; against torch's attention over
both blocks in float64. This is what a ring step computes, without the messages."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megart.models import flash_blocks
from megart.models.ring_attention import fold_in
from megart.selftest.report import Check, judged, relative_error, skip

# bf16 and fp16 inputs, fp32 accumulation: the dtype's rounding (as the fused kernels').
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def folded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal_first: bool
) -> list[torch.Tensor]:
    """Keys and values split in two blocks, each attended by flash_blocks and folded by the
    ring's own fold (log-sum-exp); then each block's backward: [out, dq, dk, dv]."""
    half = k.shape[2] // 2
    blocks = [
        (k[:, :, :half], v[:, :, :half], causal_first),
        (k[:, :, half:], v[:, :, half:], False),
    ]
    forwards = [flash_blocks.forward(q, kb, vb, causal, 0.0) for kb, vb, causal in blocks]
    c = torch.promote_types(q.dtype, torch.float32)  # the ring's fold: fp32 (float64 stays)
    out = torch.zeros(q.shape, dtype=c, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=c, device=q.device)
    every_row = slice(0, q.shape[2])
    for block_out, block_lse, _ in forwards:
        fold_in(out, lse, every_row, block_out.to(c), block_lse.to(c))
    out = out.to(q.dtype)
    grads = [flash_blocks.backward(dout, q, kb, vb, out, lse, causal, 0.0, saved)
             for (kb, vb, causal), (_, _, saved) in zip(blocks, forwards, strict=True)]  # fmt: skip
    dq = grads[0][0].double() + grads[1][0].double()
    dk, dv = (torch.cat([grads[0][i], grads[1][i]], 2) for i in (1, 2))
    return [out, dq, dk, dv]


def whole(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal_first: bool
) -> list[torch.Tensor]:
    """float64 on the CPU: one attention over both blocks, masked as ``folded``'s blocks are."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    half = k.shape[2] // 2
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal_first:
        mask[:, :half] = torch.ones(q.shape[2], half, dtype=torch.bool).tril()
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    y.backward(dout.double().cpu())
    return [y, q.grad, k.grad, v.grad]


def draw(
    seed: int, shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """q and the output gradient [b, h, n, d], keys and values [b, h, 2n, d], seeded."""
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = shape
    q, dout = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(b, h, 2 * n, d, generator=g, dtype=torch.float64) for _ in "kv")
    return [t.to(device, dtype) for t in (q, k, v, dout)]


def check_ring_blocks(device: torch.device) -> list[Check]:
    """On CUDA in bf16 and fp16 (the kernels take no fp32 there), on the CPU in fp32."""
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)
    checks = []
    for dtype in dtypes:
        name = f"ring attention flash blocks {str(dtype).removeprefix('torch.')}"
        q, k, v, dout = draw(7, (2, 4, 256, 64), device, dtype)
        if not flash_blocks.usable(q, 0.0):
            checks.append(skip(name, f"the flash kernels do not take {dtype} on {device.type}"))
            continue
        err = max(
            relative_error(a, w)
            for causal in (True, False)
            for a, w in zip(
                folded(q, k, v, dout, causal), whole(q, k, v, dout, causal), strict=True
            )
        )
        what = f"on {device.type}, 2 blocks folded, output and gradients vs float64, "
        checks.append(judged(name, err, TOLERANCE[dtype], None, "--cp-comm-type all_gather", what))
    return checks
