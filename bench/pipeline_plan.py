"""What a pipeline posting plan costs when it was made for other message costs than the run's,
by megart's simulator (no device, no timing of this machine): each built-in schedule kind at
p = 2, 4, 8 and m = p, 2p, 4p (zb-v: 2p, 4p), with every message costing a share of one chunk's
forward, timed as NCCL runs the plan (``simulate(..., posted=True)``) and divided by the
schedule as written, whose messages overlap freely (what no single communicator can do).

Rows: the message share of the run. Columns: the plan made for free messages, for the
runtime's guess (``megart.training.pipeline_costs.PLANNED_MESSAGE_SHARE``), and for the run's own
share; each the worst and the mean ratio over the schedules. Then the same for random costs
(F, B, the weight-gradient share, latency and bandwidth drawn per case): how often a plan made
for the run's costs beats one made for free messages, and whether plans made for costly
messages (the run's, and messages as long as a chunk's forward) keep the bubble when the
messages turn out free.

    python bench/pipeline_plan.py [--cases 3000] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Iterator

from megart import schedule as sched
from megart.training.pipeline_costs import PLANNED_MESSAGE_SHARE

KINDS = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("interleaved", 4),
    ("zb-h1", 1),
    ("zb-v", 2),
)
SHARES = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8)


def schedules() -> Iterator[sched.Schedule]:
    for kind, v in KINDS:
        for p in (2, 4, 8):
            for per_stage in (2, 4) if kind == "zb-v" else (1, 2, 4):
                yield sched.build(kind, p, p * per_stage, v)


def costs(share: float, chunks: int) -> sched.Costs:
    """The default computes (F = 1, B = 2, half of B weight gradients), each message ``share``
    of one of ``chunks`` chunks' forward."""
    return sched.Costs(latency=share / chunks)


def ratio(s: sched.Schedule, run: sched.Costs, planned: sched.Costs) -> float:
    """The makespan of the plan made for ``planned``, run with ``run``, over the schedule's
    as written with ``run``."""
    as_written = sched.simulate(s, costs=run).makespan
    return sched.simulate(s, posted=True, planned_for=planned, costs=run).makespan / as_written


def grid() -> None:
    print(
        "message share of a chunk's forward | plan for free messages | for the guess "
        f"({PLANNED_MESSAGE_SHARE}) | for the run's share   (worst / mean ratio to as written)"
    )
    all_schedules = list(schedules())
    for share in SHARES:
        cols = {"free": [], "guess": [], "own": []}
        for s in all_schedules:
            run = costs(share, s.chunks)
            cols["free"].append(ratio(s, run, costs(0.0, s.chunks)))
            cols["guess"].append(ratio(s, run, costs(PLANNED_MESSAGE_SHARE, s.chunks)))
            cols["own"].append(ratio(s, run, run))
        cells = " | ".join(f"{max(x):.3f} / {statistics.mean(x):.3f}" for x in cols.values())
        print(f"{share:>4} | {cells}")
    print(f"({len(all_schedules)} schedules)")


def random_costs(cases: int, seed: int) -> None:
    rng = random.Random(seed)
    own, free, kept = [], [], {}
    for _ in range(cases):
        kind, v = rng.choice(KINDS)
        p = rng.choice((2, 3, 4, 5, 8))
        m = p * rng.choice((2, 3, 4) if kind == "zb-v" else (1, 2, 3, 4))
        s = sched.build(kind, p, m, v)
        f = rng.uniform(0.5, 2.0)
        b, wf = f * rng.uniform(1.5, 3.0), rng.uniform(0.2, 0.8)
        bandwidth = rng.choice((0.0, 1.0, 4.0))
        run = sched.Costs(
            forward=f,
            backward=b,
            weight_fraction=wf,
            latency=rng.uniform(0.0, 0.4) * f / v,
            bandwidth=bandwidth,
            message_bytes=rng.uniform(0.0, 0.2) * f / v * bandwidth,
        )
        free_run = sched.Costs(forward=f, backward=b, weight_fraction=wf)
        own.append(ratio(s, run, run))
        free.append(ratio(s, run, free_run))
        costly = sched.Costs(forward=f, backward=b, weight_fraction=wf, latency=f / v)
        kept[kind] = max(kept.get(kind, 1.0), ratio(s, free_run, run), ratio(s, free_run, costly))
    better = sum(o < f - 1e-9 for o, f in zip(own, free, strict=True))
    worse = sum(o > f + 1e-9 for o, f in zip(own, free, strict=True))
    print(
        f"random costs, {cases} cases: plan for the run's costs worst {max(own):.3f} median "
        f"{statistics.median(own):.4f}; for free messages worst {max(free):.3f} median "
        f"{statistics.median(free):.4f}; the first faster in {better}, slower in {worse} "
        f"(by at most {max(o / f for o, f in zip(own, free, strict=True)):.3f}x)"
    )
    worst_kept = ", ".join(f"{k} {x:.3f}" for k, x in sorted(kept.items()))
    print(
        "plans made for the run's costs or for messages as long as a chunk's forward, run with "
        f"free messages: worst ratio to as written by kind: {worst_kept}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    grid()
    random_costs(args.cases, args.seed)


if __name__ == "__main__":
    main()
