"""The ``megart`` command: ``megart train ...`` (also ``python -m megart train ...``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = ("train",)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: megart train [--help] [Megatron-LM flags ...]", file=sys.stderr)
        return 2
    from megart.cli.train import main as train

    return train(argv[1:])
