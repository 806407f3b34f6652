"""megart plan against Korthikanti et al.'s runs with sequence parallelism and selective
recomputation on A100s (megart.plan.korthikanti says where the figures come from and how that
Megatron-LM is modelled): predicted MFU beside the published, the paper's HFU, the same runs
with full recomputation and no sequence parallelism, and the speedup between the two. CPU only,
about a minute.

    python bench/plan_korthikanti.py [--tp-overlap {none,backward,all}]

``--tp-overlap``: which tensor-parallel collectives run beside a matrix product (default
``backward``, what that Megatron-LM did; ``none`` as SC21's; ``all`` as Megatron-Core's
--tp-comm-overlap), a sensitivity check.
"""

from __future__ import annotations

import argparse

from megart.plan import korthikanti as k
from megart.plan.estimate import Estimate
from megart.plan.hardware import load_profile
from megart.plan.search import search

OVERLAP = {"none": False, "backward": k.BACKWARD_OVERLAP, "all": True}


def best(run: k.Run, selective: bool, options: dict) -> Estimate:
    gpu = load_profile("a100-80gb")
    return search(run.config(), run.gpus, gpu, k.fixed(run, selective), keep=1, **options)[0]


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp-overlap", choices=sorted(OVERLAP), default="backward")
    args = ap.parse_args()
    options = dict(k.OPTIONS, tp_overlap=OVERLAP[args.tp_overlap])
    print(f"tensor-parallel overlap: {args.tp_overlap}\n")
    print(
        "| model | GPUs | layout (selective) | MFU published | predicted | error "
        "| HFU published | predicted | full recomputation: layout | MFU predicted "
        "| speedup predicted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in (*k.README_2022, k.ABSTRACT_530B):
        sel, full = best(run, True, options), best(run, False, options)
        error = sel.mfu / (run.mfu / 100) - 1
        hfu = f"{run.hfu:g}" if run.hfu else "-"
        full_published = f" (published {run.full_mfu:g})" if run.full_mfu else ""
        speedup = full.iteration_time / sel.iteration_time
        published_speedup = f" (published {run.mfu / run.full_mfu:.3f})" if run.full_mfu else ""
        cells = [
            run.name,
            run.gpus,
            sel.layout.short(),
            f"{run.mfu:g}",
            pct(sel.mfu),
            f"{100 * error:+.1f}%",
            hfu,
            pct(sel.mfu * k.hfu_over_mfu(run)),
            full.layout.short(),
            pct(full.mfu) + full_published,
            f"{speedup:.3f}{published_speedup}",
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print("\nwhere the time goes (selective), seconds; published: the MFU's iteration time\n")
    print(
        "| model | GPUs | published | iteration | compute | tensor-parallel | bubble | pipeline "
        "| data-parallel |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in (*k.README_2022, k.ABSTRACT_530B):
        e = best(run, True, options)
        published = e.iteration_time * e.mfu / (run.mfu / 100)  # same FLOPs, published MFU
        parts = ["iteration", "compute", "tp_comm", "bubble", "pp_comm", "dp_comm"]
        times = " | ".join(f"{e.time[p]:.2f}" for p in parts)
        print(f"| {run.name} | {run.gpus} | {published:.2f} | {times} |")


if __name__ == "__main__":
    main()
