"""The ring's blocks (--cp-comm-type p2p) by torch's flash kernels against explicit products. One
rank's whole ring, in one process (no messages): each step's block by torch's flash attention op
(megart.models.flash_blocks), which returns the log-sum-exp the ring folds by, and each block's
backward by the flash backward given the folded output and log-sum-exp; against the same fold
with explicit fp32 products (what the ring computed before, and still does for fp32 on CUDA and
dropout on the CPU), and both against float64.

    python bench/ring_flash.py                     # on a GPU: accuracy, then the timing
    python bench/ring_flash.py --seq 1024 --heads 4 --dim 32   # on CPU (flash's CPU kernel)

The timing alternates the two, forward and backward of one rank's cp steps, warmed up, and
prints medians: a ratio measured in one run, on one device.

With --window W (a sliding window, W tokens back) the fused side is the ring's windowed blocks:
each block cut into its pieces inside the window, each by the masked kernels given its cached
bias (megart.selftest.ring_window_blocks.windowed_ring_rank, what the ring computes); the
explicit side is each block's fp32 products masked by global positions, a block wholly outside
the window skipped (what the ring computed before, and still does for dropout on the CPU).

    python bench/ring_flash.py --seq 4096 --heads 4 --dim 64 --window 256   # on CPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megart.models import flash_blocks
from megart.models.context_parallel import cp_positions, masked_attention
from megart.models.ring_attention import _scores, block_of, fold_in
from megart.models.window_masks import window_mask
from megart.selftest.ring_window_blocks import definition, windowed_ring_rank

Block = tuple[Tensor, Tensor, Any]  # a block's output, log-sum-exp, what its backward needs
Grads = tuple[Tensor, Tensor, Tensor]
KVs = list[tuple[Tensor, Tensor]]


def flash_block(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Block:
    """Attention of one block, its rows' log-sum-exp and what its backward needs, by torch's
    flash kernel (megart.models.flash_blocks, as the ring computes it)."""
    return flash_blocks.forward(q, k, v, causal, 0.0)


def flash_block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    extra: Any,
) -> Grads:
    """The block's share of dq, dk, dv, given the whole attention's output and log-sum-exp."""
    return flash_blocks.backward(dout, q, k, v, out, lse, causal, 0.0, extra)


def explicit_block(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Block:
    """The ring's block today: explicit products in fp32 (float64 stays float64)."""
    c = torch.promote_types(q.dtype, torch.float32)
    s = _scores(q.to(c), k.to(c), 0 if causal else None)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.to(c)).to(q.dtype), lse, None


def explicit_block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    extra: Any,
) -> Grads:
    c = torch.promote_types(q.dtype, torch.float32)
    q, k, v, dout = (x.to(c) for x in (q, k, v, dout))
    p = torch.exp(_scores(q, k, 0 if causal else None) - lse.unsqueeze(-1))
    delta = (dout * out.to(c)).sum(-1, keepdim=True)
    ds = p * (dout @ v.transpose(-1, -2) - delta) / q.shape[-1] ** 0.5
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dout


def ring_rank(
    q: Tensor, kvs: KVs, rank: int, block: Callable, block_backward: Callable, dout: Tensor
) -> list[Tensor]:
    """One rank's ring, forward and backward: the output and dq, dk, dv of every rank's K/V."""
    cp, local = len(kvs), q.shape[2]
    b, h, _, d = q.shape
    out = torch.zeros(b, h, local, d, dtype=torch.promote_types(q.dtype, torch.float32),
                      device=q.device)  # fmt: skip
    lse = torch.full((b, h, local), float("-inf"), dtype=out.dtype, device=q.device)
    extras = []
    for step in range(cp):
        k, v = kvs[(rank - step) % cp]
        rows, keys, causal = block_of(step, cp, rank, local)
        o, l, extra = block(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal)
        extras.append(extra)
        fold_in(out, lse, rows, o.to(out.dtype), l.to(out.dtype))
    out = out.to(q.dtype)
    dq = torch.zeros_like(q, dtype=lse.dtype)
    dkv = [(torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype))
           for k, v in kvs]  # fmt: skip
    for step in range(cp):
        j = (rank - step) % cp
        k, v = kvs[j]
        rows, keys, causal = block_of(step, cp, rank, local)
        gq, gk, gv = block_backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys],
                                    v[:, :, keys], out[:, :, rows],
                                    lse[:, :, rows].contiguous(), causal,
                                    extras[step])  # fmt: skip
        dq[:, :, rows] += gq
        dkv[j][0][:, :, keys] += gk
        dkv[j][1][:, :, keys] += gv
    return [out, dq] + [g for pair in dkv for g in pair]


def explicit_windowed_rank(
    q: Tensor, kvs: KVs, rank: int, window: int, dout: Tensor
) -> list[Tensor]:
    """One rank's ring with a sliding window by explicit fp32 products, each block masked by
    the global positions of its queries and keys (made per call, as the ring's tiles are) and
    skipped where no key is in any row's window: [out, dq, then dk, dv of each rank]."""
    cp, local = len(kvs), q.shape[2]
    c = torch.promote_types(q.dtype, torch.float32)
    seq, qc, doc = local * cp, q.to(c), dout.to(c)
    out = torch.zeros(q.shape, dtype=c, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=c, device=q.device)
    blocks = []
    for step in range(cp):
        j = (rank - step) % cp
        rows, keys, _ = block_of(step, cp, rank, local)
        queries = cp_positions(seq, cp, rank, q.device)[rows]
        allowed = window_mask(queries, cp_positions(seq, cp, j, q.device)[keys], window)
        if not bool(allowed.any()):
            continue
        k, v = (x[:, :, keys].to(c) for x in kvs[j])
        s = _scores(qc[:, :, rows], k, None, allowed)
        block_lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - block_lse.nan_to_num(neginf=0.0).unsqueeze(-1))
        fold_in(out, lse, rows, p @ v, block_lse)
        blocks.append((j, rows, keys, allowed, k, v))
    delta = (doc * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(out)
    grads = [[torch.zeros(k.shape, dtype=c, device=q.device) for _ in "kv"] for k, _ in kvs]
    for j, rows, keys, allowed, k, v in blocks:
        p = torch.exp(_scores(qc[:, :, rows], k, None, allowed) - lse[:, :, rows, None])
        dor = doc[:, :, rows]
        ds = p * (dor @ v.transpose(-1, -2) - delta[:, :, rows]) / q.shape[-1] ** 0.5
        dq[:, :, rows] += ds @ k
        grads[j][0][:, :, keys] += ds.transpose(-1, -2) @ qc[:, :, rows]
        grads[j][1][:, :, keys] += p.transpose(-1, -2) @ dor
    return [out.to(q.dtype), dq, *(g for pair in grads for g in pair)]


def reference(q: Tensor, kvs: KVs, rank: int, dout: Tensor) -> list[Tensor]:
    """float64: torch's attention over all keys, masked by global positions."""
    q = q.double().cpu().requires_grad_()
    ks = [k.double().cpu().requires_grad_() for k, _ in kvs]
    vs = [v.double().cpu().requires_grad_() for _, v in kvs]
    y = masked_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), len(kvs), rank, 0.0)
    grads = torch.autograd.grad(y, [q, *ks, *vs], dout.double().cpu())
    n = len(kvs)
    return [y, grads[0]] + [g for j in range(n) for g in (grads[1 + j], grads[1 + n + j])]


def draw(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> tuple[Tensor, KVs, Tensor]:
    g = torch.Generator().manual_seed(seed)
    local = args.seq // args.cp
    shape = (args.batch, args.heads, local, args.dim)
    q = torch.randn(shape, generator=g).to(device, dtype)
    kvs = [tuple(torch.randn(shape, generator=g).to(device, dtype) for _ in "kv")
           for _ in range(args.cp)]  # fmt: skip
    return q, kvs, torch.randn(shape, generator=g).to(device, dtype)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=int, default=None, help="a sliding window, tokens back")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {device}, {dtype}, torch {torch.__version__}, {vars(args)}")
    if args.window is not None:
        return windowed(args, device, dtype)

    small = argparse.Namespace(**{**vars(args), "seq": 512 * args.cp, "heads": 4})
    for cp in (2, 4):
        small.cp, small.seq = cp, 256 * cp
        q, kvs, dout = draw(small, device, dtype, seed=cp)
        for rank in range(cp):
            want = reference(q, kvs, rank, dout)
            for name, fns in (("flash", (flash_block, flash_block_backward)),
                              ("explicit", (explicit_block, explicit_block_backward))):  # fmt: skip
                got = ring_rank(q, kvs, rank, *fns, dout)
                err = max(((a.double().cpu() - w).abs().max() / w.abs().max()).item()
                          for a, w in zip(got, want, strict=True))  # fmt: skip
                print(f"cp{cp} rank {rank} {name:8s}: largest error / largest value {err:.2e}")

    q, kvs, dout = draw(args, device, dtype)
    runs = {"flash": lambda: ring_rank(q, kvs, args.cp - 1, flash_block, flash_block_backward,
                                       dout),
            "explicit": lambda: ring_rank(q, kvs, args.cp - 1, explicit_block,
                                          explicit_block_backward, dout)}  # fmt: skip
    report_times(runs, args, device)


def report_times(
    runs: dict[str, Callable[[], object]], args: argparse.Namespace, device: torch.device
) -> None:
    """Alternates ``runs`` (fused first, then explicit), a warm-up round then args.rounds;
    prints each one's median and explicit over fused."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds + 1):  # the first round warms up both
        for name, fn in runs.items():
            t = timed(fn, device)
            if round_:
                times[name].append(t)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:8s}: {med[name] * 1e3:9.2f} ms median of {[round(x * 1e3, 2) for x in t]}")
    fused, explicit = list(med)
    print(f"explicit / {fused}: {med[explicit] / med[fused]:.2f} (rank {args.cp - 1}, "
          f"forward and backward of its {args.cp} steps, no messages)")  # fmt: skip


def windowed(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """--window: accuracy of both against the float64 definition (every rank of a small
    ring), then the timing of the last rank at the given size."""
    small = argparse.Namespace(**{**vars(args), "heads": 4, "dim": 64})
    for cp in (2, 4):
        small.cp, small.seq = cp, 256 * cp
        for window in (args.window, 40, 300):
            q, kvs, dout = draw(small, device, dtype, seed=cp)
            for rank in range(cp):
                want = definition(q, kvs, rank, window, dout)
                for name, fn in (("masked", windowed_ring_rank),
                                 ("explicit", explicit_windowed_rank)):  # fmt: skip
                    got = fn(q, kvs, rank, window, dout)
                    err = max(((a.double().cpu() - w).abs().max() / w.abs().max()).item()
                              for a, w in zip(got, want, strict=True))  # fmt: skip
                    print(f"cp{cp} window {window} rank {rank} {name:8s}: largest error / "
                          f"largest value {err:.2e}")  # fmt: skip
    q, kvs, dout = draw(args, device, dtype)
    rank, w = args.cp - 1, args.window
    runs = {"masked": lambda: windowed_ring_rank(q, kvs, rank, w, dout),
            "explicit": lambda: explicit_windowed_rank(q, kvs, rank, w, dout)}  # fmt: skip
    report_times(runs, args, device)


if __name__ == "__main__":
    main()
