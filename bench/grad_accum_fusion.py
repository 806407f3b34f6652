"""Gradient accumulation fusion against --no-gradient-accumulation-fusion, in one process (or,
with --compare residual, the 16-bit residual stream against --fp32-residual-connection; with
--compare weights, fp32 weights under autocast against --half-weights).

Builds two trainers of the same GPT (same seed, same data), one fused (megart's default: the
weight-gradient product adds into the fp32 gradients itself) and one not (the product in the
compute dtype, then a cast and an add), and times their iterations in alternating rounds after a
warm-up round: medians of the per-round seconds per iteration, and their ratio (the second
mode's over the first's). On a GPU the
default is the 1.2B GPT of bench/RESULTS.md's profiled run (24 x 2048, seq 2048, micro batch 4,
8 microbatches, bf16); on a CPU pass a small one.

    python bench/grad_accum_fusion.py [--layers 24 --hidden 2048 --heads 16 --micro-batch 4]
        [--profile] [--compare residual|weights]
    python bench/grad_accum_fusion.py --layers 2 --hidden 128 --heads 4 --seq 128 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from layer_profile import kernel_ms  # bench/layer_profile.py, beside this file

# Each comparison's two modes: the TrainConfig fields each sets (megart's default first).
COMPARISONS = {
    "fusion": {
        "fused": dict(gradient_accumulation_fusion=True),
        "unfused": dict(gradient_accumulation_fusion=False),
    },
    "residual": {"16-bit": {}, "fp32": dict(fp32_residual_connection=True)},
    "weights": {"fp32": {}, "16-bit": dict(half_weights=True)},
}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _worker(args: argparse.Namespace) -> dict:
    import megart.distributed as dist
    from megart.training.config import TrainConfig
    from megart.training.trainer import Trainer

    dist.init()
    modes = COMPARISONS[args.compare]
    trainers = {
        mode: Trainer(
            TrainConfig(
                num_layers=args.layers,
                hidden_size=args.hidden,
                num_attention_heads=args.heads,
                seq_length=args.seq,
                micro_batch_size=args.micro_batch,
                global_batch_size=args.micro_batch * args.microbatches,
                train_iters=10**6,
                eval_iters=0,
                bf16=args.dtype == "bf16",
                fp16=args.dtype == "fp16",
                **fields,
            )
        )
        for mode, fields in modes.items()
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    tflops: dict[str, list[float]] = {m: [] for m in modes}
    it = 0
    for round_ in range(args.rounds + 1):  # round 0 warms up (and creates Adam's state)
        for mode, trainer in trainers.items():
            _synchronize()
            t0 = time.perf_counter()
            figures = [trainer.train_step(it + i) for i in range(args.iters)]
            _synchronize()
            if round_:
                times[mode].append((time.perf_counter() - t0) / args.iters)
                tflops[mode].append(statistics.median(f["tflops_per_gpu"] for f in figures))
        it += args.iters
    losses = {m: t.train_step(it)["loss"] for m, t in trainers.items()}
    it += 1
    kernels = {}
    if args.profile and torch.cuda.is_available():
        for mode, trainer in trainers.items():
            counter = iter(range(it, it + 10))
            kernels[mode] = kernel_ms(lambda t=trainer, c=counter: t.train_step(next(c)), 1)[0]
            it += 10
    first = next(iter(trainers.values()))
    params = sum(p.numel() for c in first.chunks for p in c.parameters())
    return {
        "params": params,
        "times_s": times,
        "tflops_per_gpu": tflops,
        "last_loss": losses,
        "kernel_ms": kernels,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--compare", choices=sorted(COMPARISONS), default="fusion")
    p.add_argument("--iters", type=int, default=2, help="iterations per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--profile",
        action="store_true",
        help="then one iteration of each under torch's "
        "profiler (GPU): device ms by kernel kind, as bench/layer_profile.py sorts them",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from megart.launcher import launch

    r = launch(_worker, 1, args, timeout=3600)[0]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"GPT {args.layers} x {args.hidden}, {r['params'] / 1e6:,.1f}M parameters, seq "
        f"{args.seq}, {args.microbatches} microbatches of {args.micro_batch}, {args.dtype}, "
        f"{device}; {args.rounds} rounds of {args.iters} iterations after a warm-up round"
    )
    modes = list(COMPARISONS[args.compare])
    med = {m: statistics.median(r["times_s"][m]) for m in modes}
    for m in modes:
        spread = f"{min(r['times_s'][m]) * 1e3:.1f}-{max(r['times_s'][m]) * 1e3:.1f}"
        print(
            f"{m:<9}{med[m] * 1e3:>10.1f} ms / iteration (rounds {spread}), "
            f"{statistics.median(r['tflops_per_gpu'][m]):.1f} TFLOP/s, "
            f"loss after the rounds {r['last_loss'][m]:.4f}"
        )
    print(f"{modes[1]} / {modes[0]}: {med[modes[1]] / med[modes[0]]:.3f}")
    if r["kernel_ms"]:
        kinds = sorted({k for by_kind in r["kernel_ms"].values() for k in by_kind})
        print("device ms of one iteration by kernel kind: " + ", ".join(modes))
        for k in kinds:
            print(f"  {k:<34}" + "".join(f"{r['kernel_ms'][m].get(k, 0.0):>10.1f}" for m in modes))
        totals = "".join(f"{sum(r['kernel_ms'][m].values()):>10.1f}" for m in modes)
        print(f"  {'all':<34}{totals}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device, **r}, f, indent=2)


if __name__ == "__main__":
    main()
