"""The distributed optimizer (--use-distributed-optimizer, ZeRO-1) against the plain one (CPU).

N data-parallel ranks (default 2) each build two trainers of the same GPT, one per optimizer,
and time them in alternating rounds. Reported per rank: Adam's state bytes (the moments, read
from the optimizer) and the median iteration time (the slowest rank's per round). (The shm
transport counts point-to-point bytes only, so the collectives' traffic is not reported: a
reduce-scatter plus an all-gather move what the all-reduce they replace moves.)

    python bench/distributed_optimizer.py [--nproc 2 --layers 4 --hidden 256 --rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dp_overlap import timed_rounds  # bench/dp_overlap.py, beside this file

MODES = {"plain": False, "distributed": True}


def _moment_bytes(optimizer: object) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)  # the distributed one wraps its own
    return sum(
        t.numel() * t.element_size()
        for state in inner.state.values()
        for key, t in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )


def _worker(args: argparse.Namespace) -> dict:
    import megart.distributed as dist
    from megart.training.config import TrainConfig
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    torch.set_num_threads(1)
    dist.init()
    tokens = builtin_corpus(1 << 20)
    trainers = {
        mode: Trainer(
            TrainConfig(
                num_layers=args.layers,
                hidden_size=args.hidden,
                num_attention_heads=args.hidden // 64,
                seq_length=args.seq,
                micro_batch_size=args.micro_batch,
                global_batch_size=args.micro_batch * 2 * args.nproc,
                train_iters=10**6,
                eval_iters=0,
                use_distributed_optimizer=on,
            ),
            tokens=tokens,
        )
        for mode, on in MODES.items()
    }
    steps = {mode: trainer.train_step for mode, trainer in trainers.items()}
    # Round 0 warms up (and creates Adam's state).
    times = timed_rounds(steps, args.rounds, args.iters)
    params = sum(p.numel() for c in trainers["plain"].chunks for p in c.parameters())
    return {
        "params": params,
        "moment_bytes": {m: _moment_bytes(t.optimizer) for m, t in trainers.items()},
        "times_s": times,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="iterations per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from megart.launcher import launch

    ranks = launch(_worker, args.nproc, args, timeout=1800)
    n = ranks[0]["params"]
    print(
        f"GPT {args.layers} x {args.hidden}, {n / 1e6:.1f}M parameters, {args.nproc} "
        "data-parallel ranks, shm transport; per rank:"
    )
    print(f"{'optimizer':<13}{'Adam moments':>14}{'ms / iteration':>16}")
    for mode in MODES:
        moments = max(r["moment_bytes"][mode] for r in ranks)
        med = statistics.median(ranks[0]["times_s"][mode])
        print(f"{mode:<13}{moments / 2**20:>10.2f} MiB{med * 1e3:>16.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": ranks}, f, indent=2)


if __name__ == "__main__":
    main()
