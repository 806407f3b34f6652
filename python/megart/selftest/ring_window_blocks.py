"""The ring's blocks under a sliding window (--cp-comm-type p2p with --window-size) on this
device: one rank's whole ring in one process (no messages), each step's block cut into the
pieces inside the window (megart.models.ring_window), each piece by the masked kernels
(megart.models.flash_blocks.masked_forward: CUDA's memory-efficient kernel, the CPU's flash
kernel, given the piece's cached bias), folded by the ring's own fold, and each piece's
backward given the folded output and log-sum-exp; against the definition in float64 (each query
attends to itself and the ``window`` tokens before it). Every rank of a cp 2 ring, with a window
shorter than a chunk and one longer than a rank's tokens. On a GPU this is the branch the CPU
suite cannot run (unverified on a GPU when written)."""

from __future__ import annotations

import torch

from megart.models import flash_blocks
from megart.models.context_parallel import cp_positions
from megart.models.ring_attention import block_of, fold_in
from megart.models.ring_window import pieces
from megart.selftest.report import Check, judged, relative_error, skip
from megart.selftest.ring_blocks import TOLERANCE

CP, SEQ = 2, 1024  # two ranks of 512 tokens, chunks of 256
WINDOWS = (100, 700)

KVs = list[tuple[torch.Tensor, torch.Tensor]]


def windowed_ring_rank(
    q: torch.Tensor, kvs: KVs, rank: int, window: int, dout: torch.Tensor
) -> list[torch.Tensor]:
    """``rank``'s ring over every rank's K/V (``kvs``, rank order; heads as q's), forward and
    backward, by the masked kernels piece by piece: [out, dq, then dk, dv of each rank]."""
    cp, (b, h, local, d) = len(kvs), q.shape
    c = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(b, h, local, d, dtype=c, device=q.device)
    lse = torch.full((b, h, local), float("-inf"), dtype=c, device=q.device)
    steps = []
    for step in range(cp):
        k, v = kvs[(rank - step) % cp]
        rows, keys, _ = block_of(step, cp, rank, local)
        parts = pieces(step, cp, rank, local, rows, keys, window)
        saves = []
        for p in parts:
            bias = p.bias(window, q.dtype, q.device)
            o, part_lse, saved = flash_blocks.masked_forward(
                q[:, :, p.rows], k[:, :, p.keys], v[:, :, p.keys], bias, p.causal, 0.0
            )
            saves.append(saved)
            fold_in(out, lse, p.rows, o.to(c), part_lse.to(c))
        steps.append((parts, saves))
    out = out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=c, device=q.device)
    grads = [[torch.zeros(k.shape, dtype=c, device=q.device) for _ in "kv"] for k, _ in kvs]
    for step, (parts, saves) in enumerate(steps):
        j = (rank - step) % cp
        k, v = kvs[j]
        for p, saved in zip(parts, saves, strict=True):
            dor, qr, outr, lser = (x[:, :, p.rows].contiguous() for x in (dout, q, out, lse))
            bias = p.bias(window, q.dtype, q.device)
            gq, gk, gv = flash_blocks.masked_backward(
                dor, qr, k[:, :, p.keys], v[:, :, p.keys], outr, lser, bias, p.causal, 0.0, saved
            )
            dq[:, :, p.rows] += gq
            grads[j][0][:, :, p.keys] += gk
            grads[j][1][:, :, p.keys] += gv
    return [out, dq, *(g for pair in grads for g in pair)]


def definition(
    q: torch.Tensor, kvs: KVs, rank: int, window: int, dout: torch.Tensor
) -> list[torch.Tensor]:
    """float64 on the CPU: softmax of ``rank``'s queries over every key at most ``window``
    tokens back (global positions of the load-balanced split), written out."""
    cp, local = len(kvs), q.shape[2]
    q = q.detach().double().cpu().requires_grad_()
    ks = [k.detach().double().cpu().requires_grad_() for k, _ in kvs]
    vs = [v.detach().double().cpu().requires_grad_() for _, v in kvs]
    i = cp_positions(local * cp, cp, rank, None).unsqueeze(1)
    j = torch.cat([cp_positions(local * cp, cp, r, None) for r in range(cp)]).unsqueeze(0)
    scores = q @ torch.cat(ks, 2).transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~((j <= i) & (j >= i - window)), float("-inf"))
    y = torch.softmax(scores, dim=-1) @ torch.cat(vs, 2)
    grads = torch.autograd.grad(y, [q, *ks, *vs], dout.double().cpu())
    return [y, grads[0], *(g for r in range(cp) for g in (grads[1 + r], grads[1 + cp + r]))]


def draw(
    seed: int, shape: tuple[int, int, int, int], cp: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, KVs, torch.Tensor]:
    """A rank's q and output gradient, and every rank's K and V ([b, h, local, d]), seeded."""
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in "qo")
    kvs = [tuple(torch.randn(shape, generator=g, dtype=torch.float64) for _ in "kv")
           for _ in range(cp)]  # fmt: skip
    on = [t.to(device, dtype) for t in (q, dout)]
    return on[0], [(k.to(device, dtype), v.to(device, dtype)) for k, v in kvs], on[1]


def check_ring_window_blocks(device: torch.device) -> list[Check]:
    """On CUDA in bf16 and fp32 (the memory-efficient kernel takes both), on the CPU in fp32."""
    dtypes = (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32,)
    checks = []
    for dtype in dtypes:
        name = f"ring attention windowed blocks {str(dtype).removeprefix('torch.')}"
        q, kvs, dout = draw(9, (1, 4, SEQ // CP, 64), CP, device, dtype)
        if not flash_blocks.masked_usable(q, 0.0):
            checks.append(skip(name, f"the masked kernels do not take {dtype} on {device.type}"))
            continue
        err = max(
            relative_error(a, w)
            for window in WINDOWS
            for rank in range(CP)
            for a, w in zip(
                windowed_ring_rank(q, kvs, rank, window, dout),
                definition(q, kvs, rank, window, dout),
                strict=True,
            )
        )
        what = f"on {device.type}, cp{CP} ranks' windowed pieces folded, vs float64, "
        checks.append(judged(name, err, TOLERANCE[dtype], None, "--cp-comm-type all_gather", what))
    return checks
