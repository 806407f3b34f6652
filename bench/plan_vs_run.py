"""megart plan's prediction beside a measured run, as a markdown table: the iteration time and,
from a GPU run's log, memory (plan's parameters + gradients + optimizer against the static
allocation held between iterations; plan's total against the peak allocation).

    python bench/plan_vs_run.py --log-jsonl run.jsonl --gpu h100-80gb --num-gpus 8 \\
        --num-layers 24 --hidden-size 2048 ... (megart plan's flags: the run's model and layout)

Every flag but --log-jsonl goes to `megart plan --json --top 1`; give the run's layout flags
(tensor/pipeline sizes, micro batch, recomputation, ...) or plan predicts the layout it would
recommend instead, which the table's last line names. A log without memory figures (a CPU run)
gives the time row only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Sequence
from typing import Any

from megart.cli import plan as plan_cli
from megart.plan.hardware import GIB
from megart.training.reporting import WARMUP_ITERS


def measured(path: str) -> dict[str, Any]:
    """The run's figures: its mean iteration time (after the warm-up iterations, as megart
    train's summary line), the last static allocation and the peak allocation (rank 0's)."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        raise SystemExit(f"plan_vs_run: {path} has no iterations")
    timed = records[WARMUP_ITERS:] if len(records) > WARMUP_ITERS else records
    peaks = [r["mem_max_allocated_bytes"] for r in records if "mem_max_allocated_bytes" in r]
    return {
        "iterations": len(records),
        "iteration_time_s": sum(r["time_s"] for r in timed) / len(timed),
        "static_bytes": records[-1].get("mem_static_bytes"),
        "max_allocated_bytes": max(peaks) if peaks else None,
    }


def predicted(plan_args: Sequence[str]) -> dict[str, Any]:
    """`megart plan --json`'s recommended (first) layout, from its own command line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = plan_cli.main([*plan_args, "--json", "--top", "1"])
    if status != 0:  # plan said why on stderr
        raise SystemExit(status)
    return json.loads(out.getvalue())


def table(plan: dict[str, Any], run: dict[str, Any]) -> str:
    """The markdown table: a row per figure, predicted, measured and their ratio."""
    mem = plan["memory_gib"]
    held = mem["parameters"] + mem["gradients"] + mem["optimizer"]  # what stays across steps
    rows = [("iteration time (s)", plan["iteration_time_s"], run["iteration_time_s"])]
    if run["static_bytes"] is not None:
        rows.append(("params + grads + optimizer vs static (GiB)", held, run["static_bytes"] / GIB))
    if run["max_allocated_bytes"] is not None:
        peak = run["max_allocated_bytes"] / GIB
        rows.append(("total vs max allocated (GiB)", mem["total"], peak))
    lines = [
        "| figure | predicted | measured | measured / predicted |",
        "|---|---:|---:|---:|",
    ]
    for name, want, got in rows:
        ratio = f"{got / want:.2f}" if want else "n/a"
        lines.append(f"| {name} | {want:.4g} | {got:.4g} | {ratio} |")
    lines += [
        "",
        f"plan: {plan['num_gpus']} x {plan['gpu']}, layout `{plan['layout']['flags']}`; "
        f"run: {run['iterations']} iterations, time the mean after the first {WARMUP_ITERS}; "
        "plan's memory is its worst rank's, the run's is rank 0's",
    ]
    if run["static_bytes"] is None:
        lines.append("no memory figures in the log (not a CUDA run): time only")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("\n", " "), allow_abbrev=False
    )
    p.add_argument("--log-jsonl", required=True, help="the run's megart train --log-jsonl file")
    args, plan_args = p.parse_known_args(argv)
    print(table(predicted(plan_args), measured(args.log_jsonl)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
