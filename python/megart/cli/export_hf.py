"""megart export-hf: a training checkpoint to a Hugging Face GPT-2 directory, in one process.

The checkpoint may come from any tensor- and pipeline-parallel layout (interleaved too): its
files are merged here, with no launcher and no process group.

    megart export-hf --load CHECKPOINT_DIR --output GPT2_DIR [--iteration N]

GPT2_DIR then holds config.json and model.safetensors, which
``transformers.GPT2LMHeadModel.from_pretrained(GPT2_DIR)`` and megart's
``GPT.from_hf_gpt2(GPT2_DIR)`` load.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megart.cli.hf_common import run_conversion


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megart export-hf", description=__doc__.splitlines()[0])
    p.add_argument(
        "--load", required=True, metavar="DIR", help="a directory that megart train --save wrote"
    )
    p.add_argument("--output", required=True, metavar="DIR", help="where to write the GPT-2 files")
    p.add_argument(
        "--iteration", type=int, metavar="N", help="the checkpoint to export (default: latest)"
    )
    args = p.parse_args(argv)

    def convert() -> str:
        from megart.training.export_hf import export_checkpoint

        out = export_checkpoint(args.load, args.output, args.iteration)
        return f"{out}: config.json and model.safetensors (GPT-2)"

    return run_conversion("megart export-hf", convert)
