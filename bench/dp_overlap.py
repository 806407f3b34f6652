"""Data-parallel gradient reduction overlapped with backward, against reducing after it (CPU).

Two ranks (data parallel, one per core) train the same GPT. In alternating rounds the gradient
buckets are reduced either as soon as each is complete during backward (megart's default) or
all after backward (the baseline). A one-process run of the same per-rank work gives the
compute-only time. Reported: median iteration times and the share of the baseline's exposed
communication (baseline - compute) that overlapping hides.

    python bench/dp_overlap.py [--layers 4 --hidden 256 --rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch


def _config(args: argparse.Namespace, global_batch: int) -> object:
    from megart.training.config import TrainConfig

    return TrainConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.hidden // 64,
        seq_length=args.seq,
        micro_batch_size=args.micro_batch,
        global_batch_size=global_batch,
        train_iters=10**6,
    )


def timed_rounds(
    steps: dict[str, Callable[[int], object]], rounds: int, iters: int
) -> dict[str, list[float]]:
    """Runs each mode's ``step(iteration)`` ``iters`` times per round, the modes alternating,
    for a warm-up round and then ``rounds`` timed ones; returns, by mode, the slowest rank's
    seconds per iteration of each timed round. Every rank calls it (a barrier starts each
    mode's turn). bench/distributed_optimizer.py times its optimizers with it too."""
    import megart.distributed as dist

    times: dict[str, list[float]] = {m: [] for m in steps}
    it = 0
    for round_ in range(rounds + 1):  # round 0 warms up
        for mode, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                step(it)
                it += 1
            mine = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(mine, op="max")
            if round_:
                times[mode].append(mine.item())
    return times


def _step(trainer: object, overlap: bool, iteration: int) -> None:
    trainer.buckets.overlap = overlap
    trainer.train_step(iteration)


def _worker(args: argparse.Namespace, ranks: int) -> tuple[dict[str, list[float]], int]:
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(_config(args, args.per_rank_batch * ranks), tokens=builtin_corpus(1 << 20))
    modes = {"overlap": True, "after backward": False} if ranks > 1 else {"compute only": True}
    steps = {mode: functools.partial(_step, trainer, overlap) for mode, overlap in modes.items()}
    times = timed_rounds(steps, args.rounds, args.iters)
    params = sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())
    return times, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--per-rank-batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=3, help="iterations per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from megart.launcher import launch

    two, n = launch(_worker, 2, args, 2, timeout=1800)[0]
    one, _ = launch(_worker, 1, args, 1, timeout=1800)[0]
    med = {m: statistics.median(t) for m, t in {**two, **one}.items()}
    exposed = med["after backward"] - med["compute only"]
    hidden = (med["after backward"] - med["overlap"]) / exposed if exposed > 0 else float("nan")
    print(
        f"GPT {args.layers} x {args.hidden}, {n / 1e6:.1f}M parameters "
        f"({4 * n / 2**20:.0f} MiB of fp32 gradients), 2 data-parallel ranks, shm transport"
    )
    for mode, t in med.items():
        print(f"{mode:<16}{t * 1e3:>9.1f} ms / iteration")
    print(f"overlap hides {hidden:.0%} of the communication exposed after backward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_s": med, "all_s": {**two, **one}, "hidden": hidden}, f, indent=2)


if __name__ == "__main__":
    main()
