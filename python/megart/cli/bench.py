"""megart-bench: microbenchmarks.

``megart-bench schedule`` simulates pipeline schedules; ``megart-bench {allreduce, allgather,
reducescatter, p2p}`` measures the communicators in nccl-tests' columns.
"""

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
        "compares every kind (gpipe, 1f1b, interleaved, zb-h1, zb-v) on one model.",
    )
    p.add_argument("--kind", choices=[*sched.KINDS, "all"], default="all")
    p.add_argument("--stages", "-p", type=int, default=4, help="pipeline stages p (default 4)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches m (default 8)")
    p.add_argument(
        "--chunks",
        "-v",
        type=int,
        default=None,
        help="model chunks per rank v: interleaved (default 2); zb-v always runs 2",
    )
    p.add_argument(
        "--forward-time",
        type=float,
        default=1.0,
        help="one microbatch's forward through a rank's share of the model",
    )
    p.add_argument(
        "--backward-time", type=float, default=2.0, help="the whole backward: I plus W (t_i + t_w)"
    )
    p.add_argument(
        "--weight-fraction",
        type=float,
        default=0.5,
        help="share of the backward spent on weight gradients (W) in zb-h1 and zb-v; "
        "t_w = fraction x backward, t_i the rest (default 0.5: t_f = t_i = t_w)",
    )
    p.add_argument("--latency", type=float, default=0.0, help="per message")
    p.add_argument("--bandwidth", type=float, default=0.0, help="bytes per unit time; 0: unlimited")
    p.add_argument("--message-bytes", type=float, default=0.0, help="bytes per inter-stage tensor")
    p.add_argument("--png", metavar="FILE", help="draw the timelines to FILE (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_schedule)


def run_schedule(args: argparse.Namespace) -> int:
    kinds = sched.KINDS if args.kind == "all" else (args.kind,)
    if args.json and len(kinds) > 1:
        raise MegartError("--json prints one schedule: add --kind " + ", ".join(sched.KINDS))
    if args.chunks is not None and args.chunks != 1 and args.kind in ("gpipe", "1f1b", "zb-h1"):
        raise MegartError(f"--chunks {args.chunks} needs --kind interleaved")
    if args.chunks is not None and args.chunks != 2 and args.kind == "zb-v":
        raise MegartError(f"--chunks {args.chunks}: zb-v runs exactly 2 chunks per rank")
    runs = []
    for kind in kinds:
        chunks = {"interleaved": args.chunks or 2, "zb-v": 2}.get(kind, 1)
        s = sched.build(kind, args.stages, args.microbatches, chunks)
        sim = sched.simulate(
            s,
            forward_time=args.forward_time,
            backward_time=args.backward_time,
            latency=args.latency,
            bandwidth=args.bandwidth,
            message_bytes=args.message_bytes,
            weight_fraction=args.weight_fraction,
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


def _comm_parsers(sub: argparse._SubParsersAction) -> None:
    from megart.cli.comm_bench import BACKENDS, OPS

    for op in OPS:
        p = sub.add_parser(
            op,
            help=f"time {op} per size, nccl-tests style",
            description=f"Times {op} per size; checks every result.",
        )
        p.add_argument(
            "--backend",
            choices=BACKENDS,
            default="shm",
            help="megart's shm transport (CPU tensors), megart's nccl transport (GPU tensors, "
            "never run between GPUs), or torch.distributed's gloo as baseline",
        )
        p.add_argument(
            "--nproc",
            type=int,
            default=None,
            help="launch this many ranks (default: one rank, or torchrun's)",
        )
        p.add_argument("-b", "--minbytes", type=_bytes, default=8)
        p.add_argument("-e", "--maxbytes", type=_bytes, default=64 << 20)
        p.add_argument("-f", "--stepfactor", type=int, default=2)
        p.add_argument("-n", "--iters", type=int, default=20)
        p.add_argument("-w", "--warmup_iters", type=int, default=5)
        p.add_argument("-d", "--datatype", default="float32")
        p.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
        p.set_defaults(run=run_comm, op=op)


def _bytes(text: str) -> int:
    """nccl-tests' sizes: 8, 1K, 16M, 1G."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper()
    try:
        return int(t[:-1]) * units[t[-1]] if t[-1] in units else int(t)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8, 64K or 16M") from None


def run_comm(args: argparse.Namespace) -> int:
    from megart.cli.comm_bench import Config, launch_or_run, table

    if args.nproc is not None and args.nproc < 1:
        raise MegartError("--nproc must be at least 1")
    if args.minbytes < 1 or args.maxbytes < args.minbytes:
        raise MegartError("need 1 <= -b MIN <= -e MAX")
    if args.stepfactor < 1 or args.iters < 1 or args.warmup_iters < 0:
        raise MegartError("-f and -n must be at least 1 and -w at least 0")
    cfg = Config(
        args.op,
        args.minbytes,
        args.maxbytes,
        args.stepfactor,
        args.iters,
        args.warmup_iters,
        args.datatype,
        (args.backend,),
    )
    nproc, rows = launch_or_run(cfg, args.nproc)
    if not rows:
        return 0  # a non-zero rank under torchrun: rank 0 reports
    mine = rows[args.backend]
    print(
        f"# megart-bench {args.op}: backend {args.backend}, {nproc} ranks, "
        f"{args.iters} iters, {args.warmup_iters} warm-up"
    )
    print(table(mine))
    if args.json:
        doc = {"op": args.op, "backend": args.backend, "nproc": nproc, "rows": mine}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["wrong"] == 0 for r in mine) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megart-bench", description=__doc__)
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="{schedule,allreduce,allgather,reducescatter,p2p}",
    )
    _schedule_parser(sub)
    _comm_parsers(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (MegartError, ValueError) as e:
        # One line that says what to change, as argparse does for its own errors.
        print(f"megart-bench {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
