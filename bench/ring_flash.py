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
from megart.models.context_parallel import masked_attention
from megart.models.ring_attention import _scores, block_of, fold_in

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
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"device {device}, {dtype}, torch {torch.__version__}, {vars(args)}")

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
    runs = {"flash": (flash_block, flash_block_backward),
            "explicit": (explicit_block, explicit_block_backward)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds + 1):  # the first round warms up both
        for name, fns in runs.items():
            t = timed(lambda fns=fns: ring_rank(q, kvs, args.cp - 1, *fns, dout), device)
            if round_:
                times[name].append(t)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:8s}: {med[name] * 1e3:9.2f} ms median of {[round(x * 1e3, 2) for x in t]}")
    print(f"explicit / flash: {med['explicit'] / med['flash']:.2f} (rank {args.cp - 1}, "
          f"forward and backward of its {args.cp} steps, no messages)")  # fmt: skip


if __name__ == "__main__":
    main()
