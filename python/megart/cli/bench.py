"""megart-bench: microbenchmarks. ``megart-bench schedule`` simulates pipeline schedules."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from megart import schedule as sched
from megart.errors import MegartError
from megart.schedule.report import table


def _schedule_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schedule",
        help="simulate pipeline schedules: bubble beside theory, makespan, peak in-flight",
        description="Builds, validates and simulates pipeline schedules. With no --kind, "
        "compares gpipe, 1f1b and interleaved on one model.",
    )
    p.add_argument("--kind", choices=[*sched.KINDS, "all"], default="all")
    p.add_argument("--stages", "-p", type=int, default=4, help="pipeline stages p (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches m (default 8)")
    p.add_argument(
        "--chunks",
        "-v",
        type=int,
        default=None,
        help="model chunks per rank v, interleaved only (default 2)",
    )
    p.add_argument(
        "--forward-time",
        type=float,
        default=1.0,
        help="one microbatch's forward through a rank's share of the model",
    )
    p.add_argument("--backward-time", type=float, default=2.0)
    p.add_argument("--latency", type=float, default=0.0, help="per message")
    p.add_argument("--bandwidth", type=float, default=0.0, help="bytes per unit time; 0: unlimited")
    p.add_argument("--message-bytes", type=float, default=0.0, help="bytes per inter-stage tensor")
    p.add_argument("--png", metavar="FILE", help="draw the timelines to FILE (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_schedule)


def run_schedule(args: argparse.Namespace) -> int:
    kinds = sched.KINDS if args.kind == "all" else (args.kind,)
    if args.json and len(kinds) > 1:
        raise MegartError("--json prints one schedule: add --kind gpipe, 1f1b or interleaved")
    if args.chunks is not None and args.chunks != 1 and args.kind in ("gpipe", "1f1b"):
        raise MegartError(f"--chunks {args.chunks} needs --kind interleaved")
    runs = []
    for kind in kinds:
        chunks = (args.chunks or 2) if kind == "interleaved" else 1
        s = sched.build(kind, args.stages, args.microbatches, chunks)
        sim = sched.simulate(
            s,
            forward_time=args.forward_time,
            backward_time=args.backward_time,
            latency=args.latency,
            bandwidth=args.bandwidth,
            message_bytes=args.message_bytes,
        )
        runs.append((s, sim))
    if args.png:
        sched.draw(runs, args.png)
    if args.json:
        s, sim = runs[0]
        print(json.dumps(sched.to_dict(s, sim)))
    else:
        print(table(runs))
        if args.png:
            print(f"timeline written to {args.png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megart-bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{schedule}")
    _schedule_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (MegartError, ValueError) as e:
        # One line that says what to change, as argparse does for its own errors.
        print(f"megart-bench {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
