"""Collective and point-to-point microbenchmarks in nccl-tests' style.

Each rank times ``iters`` back-to-back ops per size after ``warmup`` ones (more when
``min_round_ms`` asks for rounds of a least that length), then checks one op on
real data against the exact expected result. Time is the slowest rank's mean per op;
algbw = bytes / time; busbw = algbw x nccl-tests' factor (allreduce 2(n-1)/n, allgather and
reducescatter (n-1)/n, p2p 1). As in nccl-tests, allgather and reducescatter sizes count all n
parts. p2p is a ring exchange: every rank sends to rank+1 and receives from rank-1 at once.

``nccl`` runs on CUDA tensors (device LOCAL_RANK) through megart's nccl transport (run on one
GPU only, never between GPUs); its ops wait on the host, so the host clock times them.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

OPS = ("allreduce", "allgather", "reducescatter", "p2p")
BACKENDS = ("shm", "gloo", "nccl")


@dataclass
class Config:
    op: str
    min_bytes: int = 8
    max_bytes: int = 64 << 20
    factor: int = 2
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    backends: tuple[str, ...] = ("shm",)
    rounds: int = 1  # >1 alternates the backends round by round (for same-run comparisons)
    # >0: per size and backend, ``iters`` grows until a round lasts this long (see _calibrate)
    min_round_ms: float = 0.0


def bus_factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reducescatter"):
        return (n - 1) / n
    return 1.0


def sizes(cfg: Config) -> list[int]:
    out, b = [], cfg.min_bytes
    while b <= cfg.max_bytes:
        out.append(b)
        b = b * cfg.factor if cfg.factor > 1 else cfg.max_bytes + 1
    return out


def _api(backend: str) -> Any:
    """The module whose torch.distributed-named functions run the ops: megart's own, or torch's
    for the gloo baseline (same names, same signatures)."""
    if backend == "gloo":
        import torch.distributed as td

        return td
    import megart.distributed as md

    return md


def _init(backends: tuple[str, ...]) -> tuple[bool, bool]:
    """Initialises megart first; gloo then shares megart's store (one TCPStore per job, as
    both would otherwise listen on MASTER_PORT). Returns whether it started megart and
    torch.distributed, for _end."""
    import torch.distributed as td

    import megart.distributed as md

    megart_backends = [b for b in backends if b != "gloo"]
    started_megart = started_torch = False
    if megart_backends and not md.is_initialized():
        md.init(backend=megart_backends[0])
        started_megart = True
    if "gloo" in backends and not td.is_initialized():
        if md.is_initialized():
            ctx = md.group.context()
            store = td.PrefixStore("gloo", ctx.store)
            td.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.world_size)
        else:
            td.init_process_group("gloo")
        started_torch = True
    return started_megart, started_torch


def _end(started_megart: bool, started_torch: bool) -> None:
    """Ends what _init started, before the interpreter's shutdown, where a torch.distributed
    group left behind can abort a process that finished cleanly (under torchrun)."""
    import torch.distributed as td

    import megart.distributed as md

    if started_torch and td.is_initialized():
        td.destroy_process_group()
    if started_megart:
        md.destroy()


class _Op:
    """Tensors and one call of an op for a size; ``check()`` counts wrong elements."""

    def __init__(
        self,
        op: str,
        nbytes: int,
        dtype: torch.dtype,
        rank: int,
        n: int,
        device: torch.device | None = None,
    ) -> None:
        self.op, self.rank, self.n = op, rank, n
        self.device = device or torch.device("cpu")
        per_rank = op in ("allgather", "reducescatter")
        self.count = max(1, nbytes // dtype.itemsize // (n if per_rank else 1))
        c = self.count

        def zeros(k: int) -> torch.Tensor:
            return torch.zeros(k, dtype=dtype, device=self.device)

        if op == "allreduce":
            self.a = zeros(c)
        elif op == "allgather":
            self.a, self.b = zeros(c), zeros(c * n)
        elif op == "reducescatter":
            self.a, self.b = zeros(c * n), zeros(c)
        else:
            self.a, self.b = zeros(c), zeros(c)

    def bytes(self) -> int:
        """nccl-tests' size: the buffer an op moves, all n parts for gather/scatter."""
        total = self.count * (self.n if self.op in ("allgather", "reducescatter") else 1)
        return total * self.a.dtype.itemsize

    def run(self, d: Any) -> None:
        if self.op == "allreduce":
            d.all_reduce(self.a)
        elif self.op == "allgather":  # torch 2.13 renamed these *_single; megart has both
            getattr(d, "all_gather_single", d.all_gather_into_tensor)(self.b, self.a)
        elif self.op == "reducescatter":
            getattr(d, "reduce_scatter_single", d.reduce_scatter_tensor)(self.b, self.a)
        else:
            nxt, prv = (self.rank + 1) % self.n, (self.rank - 1) % self.n
            works = d.batch_isend_irecv(
                [d.P2POp(d.isend, self.a, nxt), d.P2POp(d.irecv, self.b, prv)]
            )
            for w in works:
                w.wait()

    def check(self, d: Any) -> int:
        def fill(t: torch.Tensor, rank: int) -> torch.Tensor:
            return ((torch.arange(t.numel(), device=t.device) % 7) + rank).to(t.dtype)

        n, r = self.n, self.rank
        self.a.copy_(fill(self.a, r))
        self.run(d)
        if self.op == "allreduce":
            got, want = self.a, sum(fill(self.a, q).double() for q in range(n))
        elif self.op == "allgather":
            got, want = self.b, torch.cat([fill(self.a, q) for q in range(n)])
        elif self.op == "reducescatter":
            total = sum(fill(self.a, q).double() for q in range(n))
            got, want = self.b, total[r * self.count : (r + 1) * self.count]
        else:
            got, want = self.b, fill(self.b, (r - 1) % n)
        wrong = int((got.double() != want.double()).sum())
        self.a.zero_()
        if self.op != "allreduce":
            self.b.zero_()
        return wrong


def _time(op: _Op, d: Any, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        op.run(d)
    d.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op.run(d)
    return (time.perf_counter() - t0) / iters


def _calibrate(op: _Op, d: Any, cfg: Config, device: torch.device | None) -> int:
    """Iterations per round for this size: ``cfg.iters``, or enough for a round to last
    ``cfg.min_round_ms`` by one timed round, agreed on by every rank. Short rounds measure
    transients rather than the transport: after a round of gloo, whose ranks block on sockets,
    the kernel often leaves two ranks on one core for a few milliseconds, and a 1.6 ms round of
    8-byte shm ring exchanges then measured ~20 us per op instead of ~8 us."""
    mine = torch.tensor([_time(op, d, cfg.iters, cfg.warmup)], dtype=torch.float64, device=device)
    d.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    return max(cfg.iters, math.ceil(cfg.min_round_ms / 1e3 / mine.item()))


def run(cfg: Config) -> dict[str, list[dict[str, Any]]]:
    """Runs on every rank; returns, per backend, one row per size (medians over rounds)."""
    if "nccl" in cfg.backends and len(cfg.backends) > 1:
        raise ValueError("the nccl backend runs on GPU tensors: benchmark it on its own")
    started = _init(cfg.backends)
    try:
        return _measure(cfg)
    finally:
        _end(*started)


def _measure(cfg: Config) -> dict[str, list[dict[str, Any]]]:
    apis = {b: _api(b) for b in cfg.backends}
    first = apis[cfg.backends[0]]
    rank, n = first.get_rank(), first.get_world_size()
    dtype = getattr(torch, cfg.dtype)
    device = None
    if cfg.backends == ("nccl",):
        device = torch.device("cuda", torch.cuda.current_device())
    rows: dict[str, list[dict[str, Any]]] = {b: [] for b in cfg.backends}
    for nbytes in sizes(cfg):
        op = _Op(cfg.op, nbytes, dtype, rank, n, device)
        iters = dict.fromkeys(cfg.backends, cfg.iters)
        if cfg.min_round_ms > 0:  # also the discarded round that the next branch runs
            iters = {b: _calibrate(op, apis[b], cfg, device) for b in cfg.backends}
        else:
            # A discarded round at every size, as nccl-tests warms up each size: the first ops
            # of a size pay page faults of its buffers and lazy set-up in every backend (an 8 B
            # first size measured 26.8 us against 3.7-4.3 us for the next ones without it).
            for b in cfg.backends:
                _time(op, apis[b], cfg.iters, cfg.warmup)
        times: dict[str, list[float]] = {b: [] for b in cfg.backends}
        for _ in range(cfg.rounds):
            for b in cfg.backends:  # alternating: each round runs every backend once
                mine = torch.tensor(
                    [_time(op, apis[b], iters[b], cfg.warmup)], dtype=torch.float64, device=device
                )
                apis[b].all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
                times[b].append(mine.item())
        for b in cfg.backends:
            wrong = torch.tensor([op.check(apis[b])], dtype=torch.float64, device=device)
            apis[b].all_reduce(wrong)
            t = sorted(times[b])[len(times[b]) // 2]
            algbw = op.bytes() / t / 1e9
            rows[b].append(
                {
                    "bytes": op.bytes(),
                    "count": op.count,
                    "dtype": cfg.dtype,
                    "time_us": t * 1e6,
                    "algbw_gbs": algbw,
                    "busbw_gbs": algbw * bus_factor(cfg.op, n),
                    "wrong": int(wrong.item()),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'size (B)':>12}{'count':>12}{'type':>10}{'time (us)':>12}"
        f"{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}{'#wrong':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['bytes']:>12}{r['count']:>12}{r['dtype']:>10}{r['time_us']:>12.1f}"
            f"{r['algbw_gbs']:>14.3f}{r['busbw_gbs']:>14.3f}{r['wrong']:>8}"
        )
    return "\n".join(lines)


def launch_or_run(cfg: Config, nproc: int | None) -> tuple[int, dict[str, list[dict]]]:
    """Launches ``nproc`` ranks of its own, or runs in this process as one rank of a torchrun
    job. Returns (world size, rank 0's rows); under torchrun other ranks get empty rows."""
    if nproc is not None:
        from megart.launcher import launch

        return nproc, launch(run, nproc, cfg, timeout=3600)[0]
    if "RANK" not in os.environ:
        return 1, run(cfg)
    rows = run(cfg)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return world, rows if rank == 0 else {}


__all__ = ["Config", "OPS", "BACKENDS", "run", "table", "launch_or_run"]
