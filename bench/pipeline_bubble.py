"""Measured pipeline bubble of each schedule on CPU, beside the simulated one.

Two ranks (one per core) run a stack of Linear+Tanh layers split into stages with megart's
PipelineEngine. Every round times each rank's own chunks' forward and backward for the m
microbatches with no communication (the ideal), then one iteration of each schedule; the
measured bubble is the median over rounds of (iteration time / that round's ideal - 1). The
idle column needs no ideal: the time the busiest rank spent outside forward and backward
(posting, waiting) over the time inside them, by the engine's own clock, so a round in which
the machine computes slower than in the ideal's rounds does not count as bubble.
The simulator gets the measured per-microbatch forward and backward times, with the measured
cost of one activation message as per-message latency, and with free communication; for the
zero-bubble kinds (zb-h1, zb-v) it splits the backward half and half into I and W (a linear
layer's dX and dW products cost the same). The layers run through megart's linear, whose
weight gradient the zero-bubble kinds compute in W (plain F.linear for the others).

    python bench/pipeline_bubble.py [--microbatches 8] [--hidden 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from torch import nn


def _keep_freed_memory() -> None:
    """glibc hands large freed blocks back to the OS and page-faults them in again at the next
    allocation; a W that holds all of a chunk's weight gradients at once paid ~4 ms per
    microbatch for that at hidden 1024, a cost a GPU's caching allocator does not have. Every
    kind runs in the same processes with this setting."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    if not (libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)):
        print("# note: mallopt refused; freed memory goes back to the OS as usual")


KINDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))


def _worker(m: int, hidden: int, batch: int, layers: int, rounds: int) -> dict:
    import megart.distributed as dist
    from megart import schedule as sched
    from megart.pipeline import PipelineEngine, StageLink
    from megart.tensor_parallel.weight_grad import linear

    class Linear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return linear(x, self.weight, self.bias)

    torch.set_num_threads(1)
    _keep_freed_memory()
    dist.init(timeout=300)
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.ModuleList(nn.Sequential(Linear(hidden, hidden), nn.Tanh()) for _ in range(layers))
    xs = [torch.randn(batch, hidden) for _ in range(m)]
    ys = [torch.randn(batch, hidden) for _ in range(m)]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    def chunks_for(s: sched.Schedule) -> list[nn.Module]:
        per = layers // (p * s.chunks)
        stages = [s.virtual_stage(rank, c) for c in range(s.chunks)]
        return [nn.Sequential(*model[vs * per : (vs + 1) * per]) for vs in stages]

    # Ideal: this rank's share of the model, forward and backward for m microbatches with no
    # communication; timed in every round beside the schedules, so that each round's bubble
    # is measured against the compute speed of that moment.
    mine = nn.Sequential(*chunks_for(sched.build("1f1b", p, m)))
    fwd: list[float] = []
    bwd: list[float] = []

    def ideal() -> None:
        for x in xs:
            x = x.clone().requires_grad_()
            t0 = time.perf_counter()
            out = mine(x)
            t1 = time.perf_counter()
            out.sum().backward()
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)

    # One message's cost: a ring exchange of one activation between the two ranks.
    a, b = torch.randn(batch, hidden), torch.empty(batch, hidden)
    lat = []
    for _ in range(50):
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, a, (rank + 1) % p), dist.P2POp(dist.irecv, b, (rank - 1) % p)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        lat.append(time.perf_counter() - t0)
    latency = statistics.median(lat)

    link = StageLink(dist.new_group(list(range(p))))
    schedules = {kind: sched.build(kind, p, m, v) for kind, v in KINDS}
    engines = {
        kind: PipelineEngine(s, rank, chunks_for(s), link, (batch, hidden))
        for kind, s in schedules.items()
    }
    runs = {"ideal": ideal} | {k: partial(e.run, xs, ys, loss_fn) for k, e in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    compute: dict[str, list[float]] = {kind: [] for kind in engines}
    for _ in range(rounds + 1):  # the first round warms up
        for name, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            run()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            if name in engines:
                compute[name].append(engines[name].last_compute_time)
    fwd, bwd = fwd[m:], bwd[m:]  # the warm-up round's
    return {
        "t_f": statistics.median(fwd),
        "t_b": statistics.median(bwd),
        "latency": latency,
        "times": {k: v[1:] for k, v in times.items()},
        "compute": {k: v[1:] for k, v in compute.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from megart import schedule as sched
    from megart.launcher import launch

    p, m = 2, args.microbatches
    results = launch(
        _worker,
        p,
        m,
        args.hidden,
        args.batch,
        args.layers,
        args.rounds,
        timeout=1800,
        env={"OMP_NUM_THREADS": "1"},
    )
    t_f = max(r["t_f"] for r in results)
    t_b = max(r["t_b"] for r in results)
    latency = max(r["latency"] for r in results)

    def iteration(name: str, i: int) -> float:  # the slower rank's time in round i
        return max(r["times"][name][i] for r in results)

    ideal = statistics.median(iteration("ideal", i) for i in range(args.rounds))
    print(
        f"# p={p}, m={m}, per-rank forward {t_f * 1e3:.2f} ms and backward {t_b * 1e3:.2f} ms "
        f"per microbatch, one activation message {latency * 1e6:.0f} us (measured); ideal "
        f"iteration {ideal * 1e3:.1f} ms (median of {args.rounds} rounds)"
    )
    print(
        f"{'kind':<12}{'v':>3}{'iteration ms':>14}{'measured bubble':>17}"
        f"{'idle':>7}{'simulated':>11}{'sim. free comm':>16}{'theory':>9}"
    )
    for kind, v in KINDS:
        t = statistics.median(iteration(kind, i) for i in range(args.rounds))
        # Each round's bubble against that round's ideal, then the median over rounds.
        bubble = statistics.median(
            iteration(kind, i) / iteration("ideal", i) - 1 for i in range(args.rounds)
        )
        # Idle: the iteration's time beyond the busiest rank's forward and backward (the
        # engine's own clock), over the latter; median over rounds. The busiest rank, because
        # the others also wait for it when the stages are not equally fast, which the
        # schedule cannot help (on this VM one rank computes up to ~10% slower than the other).
        idle = statistics.median(
            iteration(kind, i) / max(r["compute"][kind][i] for r in results) - 1
            for i in range(args.rounds)
        )
        s = sched.build(kind, p, m, v)
        sim = sched.simulate(s, forward_time=t_f, backward_time=t_b, latency=latency)
        free = sched.simulate(s, forward_time=t_f, backward_time=t_b)
        theory = sched.theoretical_bubble(kind, p, m, v)
        print(
            f"{kind:<12}{v:>3}{t * 1e3:>14.1f}{bubble:>17.3f}{idle:>7.3f}"
            f"{sim.bubble_fraction:>11.3f}{free.bubble_fraction:>16.3f}{theory:>9.3f}"
        )


if __name__ == "__main__":
    main()
