"""CPU benchmark: megart AdamW against torch.optim.AdamW (fused=True and foreach=True).

Run as ``python bench/adam.py``. Each optimizer owns its own parameters and state; all share
the same gradients. The three are timed in turn, round after round, so that drift of the
machine (frequency, other load) hits them alike; medians over rounds are reported with ratios
against megart. ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

import megart.optim


def make_sizes(total: int, tensors: int) -> list[int]:
    # Uneven sizes, as in a real model, that add up to `total`.
    weights = torch.rand(tensors, generator=torch.Generator().manual_seed(0)) + 0.5
    sizes = (weights / weights.sum() * total).long()
    sizes[-1] += total - int(sizes.sum())
    return [int(n) for n in sizes]


def make_tensors(sizes: list[int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def time_steps(step: Callable[[], object], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=40_000_000)
    parser.add_argument("--tensors", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (median reported)")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--threads", type=int, default=None, help="megart threads (default: auto)")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()

    sizes = make_sizes(args.params, args.tensors)
    grads = make_tensors(sizes, 1)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name in ("megart", "torch fused", "torch foreach"):
        params = [p.requires_grad_(True) for p in make_tensors(sizes, 0)]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        kwargs = dict(lr=1e-3, weight_decay=1e-2)
        if name == "megart":
            optimizers[name] = megart.optim.AdamW(params, num_threads=args.threads, **kwargs)
        elif name == "torch fused":
            optimizers[name] = torch.optim.AdamW(params, fused=True, **kwargs)
        else:
            optimizers[name] = torch.optim.AdamW(params, foreach=True, **kwargs)

    for opt in optimizers.values():  # warm-up: allocate state, fault in pages
        opt.step()
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(args.rounds):
        for name, opt in optimizers.items():
            times[name].append(time_steps(opt.step, args.steps))

    medians = {name: statistics.median(t) for name, t in times.items()}
    bytes_per_step = 28 * args.params  # read p, g, m, v; write p, m, v (fp32)
    base = medians["megart"]
    print(
        f"AdamW step, {args.params / 1e6:.0f}M fp32 params in {args.tensors} tensors, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"megart threads {megart._core.optim.resolve_threads(args.threads or 0)}"
    )
    print(f"{'optimizer':<15} {'median ms':>10} {'min ms':>8} {'GB/s':>7} {'vs megart':>10}")
    for name, t in times.items():
        m = medians[name]
        print(
            f"{name:<15} {m * 1e3:>10.1f} {min(t) * 1e3:>8.1f} {bytes_per_step / m / 1e9:>7.1f} "
            f"{m / base:>9.2f}x"
        )
    print(
        f"torch fused / megart = {medians['torch fused'] / base:.2f}, "
        f"torch foreach / megart = {medians['torch foreach'] / base:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "adamw_cpu",
                    "params": args.params,
                    "tensors": args.tensors,
                    "rounds": args.rounds,
                    "steps_per_round": args.steps,
                    "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(),
                    "median_s": medians,
                    "all_s": times,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
