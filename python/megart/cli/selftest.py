"""megart selftest: checks every component megart would use on this machine and prints one
table (component, result, error against the reference, time against torch's equivalent).

    megart selftest [--json FILE]
    torchrun --nproc-per-node N -m megart selftest     (every collective vs torch's NCCL)

Exit status 0 only when nothing failed; a failing part is named with the flag that avoids it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megart selftest", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help='also write {"checks": [...]} to FILE (to stdout with no FILE, instead of the table)',
    )
    args = parser.parse_args(argv)
    from megart.selftest import run
    from megart.selftest.report import exit_status, summary, table, to_json

    checks = run()
    if int(os.environ.get("RANK", "0")) == 0:  # every rank has the same verdicts: print once
        if args.json == "-":
            print(to_json(checks))
        else:
            print(table(checks))
            print(summary(checks))
            if args.json:
                with open(args.json, "w") as f:
                    f.write(to_json(checks) + "\n")
        sys.stdout.flush()
    return exit_status(checks)
