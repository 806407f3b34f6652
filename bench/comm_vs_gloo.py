"""megart's shm transport against torch.distributed's gloo, in one run.

Both backends live in the same launched ranks; for every size the rounds alternate shm, gloo,
shm, gloo, ... and each backend's time is the median over rounds of the slowest rank's mean per
op. Every result is checked. Usage:

    python bench/comm_vs_gloo.py [--nproc 2] [--ops allreduce p2p] [-e 16M] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

from megart.cli.comm_bench import OPS, Config
from megart.launcher import launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("-b", type=int, default=8)
    p.add_argument("-e", type=int, default=16 << 20)
    p.add_argument("-f", type=int, default=4)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--min-round-ms",
        type=float,
        default=20.0,
        help="per size and backend, -n grows until a round lasts this long (0: -n exactly)",
    )
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    from megart.cli.comm_bench import run

    print(
        f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, "
        f"{args.nproc} ranks, {args.rounds} alternating rounds of >= {args.n} ops and "
        f">= {args.min_round_ms:g} ms, medians"
    )
    doc = {}
    for op in args.ops:
        cfg = Config(
            op,
            args.b,
            args.e,
            args.f,
            args.n,
            5,
            "float32",
            ("shm", "gloo"),
            args.rounds,
            min_round_ms=args.min_round_ms,
        )
        rows = launch(run, args.nproc, cfg, timeout=3600)[0]
        doc[op] = rows
        print(f"\n## {op}")
        print(
            f"{'bytes':>10}{'shm us':>10}{'gloo us':>10}{'gloo/shm':>10}"
            f"{'shm busbw':>11}{'gloo busbw':>11}{'ratio':>8}{'#wrong':>8}"
        )
        for s, g in zip(rows["shm"], rows["gloo"], strict=True):
            print(
                f"{s['bytes']:>10}{s['time_us']:>10.1f}{g['time_us']:>10.1f}"
                f"{g['time_us'] / s['time_us']:>9.1f}x{s['busbw_gbs']:>11.3f}"
                f"{g['busbw_gbs']:>11.3f}{s['busbw_gbs'] / max(g['busbw_gbs'], 1e-12):>7.2f}x"
                f"{s['wrong'] + g['wrong']:>8}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
