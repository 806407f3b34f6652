"""megart plan against BigScience's measured sweep of layouts for a 181B GPT on 384 A100s
(megart.plan.bigscience says where the figures come from and how that stack is modelled): each
measured layout's predicted iteration time and memory beside the measurement, then the
planner's own choice, and the best layout it finds at each tensor-parallel size.

    python bench/plan_bigscience.py [--rail-gb-per-s X]

``--rail-gb-per-s``: the per-GPU inter-node bandwidth (default: Jean Zay's 4 x 100 Gb/s per
node at 0.95 of line rate, 5.94 GB/s), for a sensitivity check.
"""

from __future__ import annotations

import argparse
import dataclasses

from megart.plan import bigscience as bs
from megart.plan.estimate import estimate
from megart.plan.search import NoFit, search

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rail-gb-per-s", type=float, default=None)
    args = ap.parse_args()
    gpu = bs.cluster()
    if args.rail_gb_per_s is not None:
        gpu = dataclasses.replace(gpu, rail_gb_per_s=args.rail_gb_per_s)
    print(f"rails: {gpu.rail_gb_per_s:.2f} GB/s per GPU; NVLink {gpu.nvlink_bus_gb_per_s} GB/s")
    print("| layout | batch | measured s | predicted s | predicted / measured | memory GiB |")
    print("|---|---|---|---|---|---|")
    for run in bs.SWEEP_2022_02_25:
        e = estimate(bs.config(run.global_batch), run.layout(), gpu, **bs.OPTIONS)
        name = f"t{run.tp} p{run.pp} d{run.dp} b{run.micro_batch}"
        measured = f"{run.seconds:.2f}" if run.seconds else "out of memory"
        ratio = f"{e.iteration_time / run.seconds:.3f}" if run.seconds else ""
        fits = "" if e.fits else " (does not fit)"
        memory = f"{e.memory['total'] / GIB:.1f}{fits}"
        cells = [name, run.global_batch, measured, f"{e.iteration_time:.2f}", ratio, memory]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    print("best predicted layout at each tensor-parallel size (global batch 2048):")
    for t in (1, 2, 4, 8):
        fixed = dataclasses.replace(bs.FIXED, tp=t)
        try:
            e = search(bs.config(), bs.GPUS, gpu, fixed, keep=1, **bs.OPTIONS)[0]
        except NoFit:
            print(f"  t{t}: nothing fits")
            continue
        lay = e.layout
        print(
            f"  t{t}: t{lay.tp} p{lay.pp} d{lay.dp} b{lay.micro_batch} "
            f"{e.iteration_time:.1f} s, {e.tflops_per_gpu:.1f} TFLOP/s"
        )
    measured = [r for r in bs.SWEEP_2022_02_25 if r.seconds and r.global_batch == 2048]
    for t in (2, 4, 8):
        best = min((r for r in measured if r.tp == t), key=lambda r: r.seconds, default=None)
        if best:
            layout = f"p{best.pp} b{best.micro_batch}"
            print(f"  measured best at t{t}, batch 2048: {layout} {best.seconds} s")


if __name__ == "__main__":
    main()
