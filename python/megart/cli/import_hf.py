"""megart import-hf: a Hugging Face GPT-2 directory as a megart checkpoint, to fine-tune.

    megart import-hf --input GPT2_DIR --save CHECKPOINT_DIR [--seq-length N]
        [--apply-layernorm-1p]

CHECKPOINT_DIR then holds a release checkpoint (the weights alone) that ``megart train --load
CHECKPOINT_DIR`` loads under any tensor- and pipeline-parallel layout, starting at iteration 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megart.cli.hf_common import run_conversion


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megart import-hf", description=__doc__.splitlines()[0])
    p.add_argument(
        "--input", required=True, metavar="DIR", help="a GPT-2 directory (save_pretrained files)"
    )
    p.add_argument("--save", required=True, metavar="DIR", help="where to write the checkpoint")
    p.add_argument(
        "--seq-length",
        type=int,
        metavar="N",
        help="keep the first N learned positions (default: all, GPT-2's n_positions)",
    )
    p.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="store the LayerNorm weights zero-centred (GPT-2's minus 1), for megart train "
        "--apply-layernorm-1p: the same network",
    )
    args = p.parse_args(argv)

    def convert() -> str:
        from megart.training.import_hf import import_checkpoint

        out = import_checkpoint(args.input, args.save, args.seq_length, args.apply_layernorm_1p)
        return f"{out}: release checkpoint; train with --load {args.save}"

    return run_conversion("megart import-hf", convert)
