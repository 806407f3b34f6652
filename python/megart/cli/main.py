"""The ``megart`` command: ``megart train ...`` (also ``python -m megart train ...``) and
``megart preprocess-data ...``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = ("train", "preprocess-data")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(
            "usage: megart train [--help] [Megatron-LM flags ...]\n"
            "       megart preprocess-data [--help] --input FILE --output-prefix PREFIX ...",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "preprocess-data":
        from megart.cli.preprocess import main as preprocess

        return preprocess(argv[1:])
    from megart.cli.train import main as train

    return train(argv[1:])
