"""The ``megart`` command: ``megart train ...`` (also ``python -m megart train ...``),
``megart preprocess-data ...``, ``megart export-hf ...`` and ``megart import-hf ...``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = (
    "train",
    "preprocess-data",
    "export-hf",
    "import-hf",
    "plan",
    "selftest",
    "convert-checkpoint",
)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(
            "usage: megart train [--help] [Megatron-LM flags ...]\n"
            "       megart preprocess-data [--help] --input FILE --output-prefix PREFIX ...\n"
            "       megart export-hf [--help] --load CHECKPOINT_DIR --output GPT2_DIR\n"
            "       megart import-hf [--help] --input GPT2_DIR --save CHECKPOINT_DIR\n"
            "       megart plan [--help] --gpu NAME --num-gpus N [megart train's model flags]\n"
            "       megart selftest [--help] [--json [FILE]]\n"
            "       megart convert-checkpoint [--help] --from F --to T --load DIR --save DIR",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "preprocess-data":
        from megart.cli.preprocess import main as preprocess

        return preprocess(argv[1:])
    if argv[0] == "export-hf":
        from megart.cli.export_hf import main as export_hf

        return export_hf(argv[1:])
    if argv[0] == "selftest":
        from megart.cli.selftest import main as selftest

        return selftest(argv[1:])
    if argv[0] == "import-hf":
        from megart.cli.import_hf import main as import_hf

        return import_hf(argv[1:])
    if argv[0] == "plan":
        from megart.cli.plan import main as plan

        return plan(argv[1:])
    if argv[0] == "convert-checkpoint":
        from megart.cli.convert import main as convert

        return convert(argv[1:])
    from megart.cli.train import main as train

    return train(argv[1:])
