"""megart train: trains GPT with Megatron-LM's flag names. With no arguments it trains a small
GPT on the built-in corpus (the Python standard library's sources, as bytes).

    megart train [--num-layers 4 --hidden-size 128 ...]
    torchrun --nproc-per-node 4 -m megart train --tensor-model-parallel-size 2 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from megart.errors import MegartError
from megart.training.config import TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, named as Megatron-LM names it (--hidden-size ...)."""
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "scatter_gather_tensors_in_pipeline":
            p.add_argument(
                "--no-scatter-gather-tensors-in-pipeline",
                dest=f.name,
                action="store_false",
                help="send whole activations between stages (no 1/t slices)",
            )
        elif f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action="store_true")
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            p.add_argument(
                flag,
                dest=f.name,
                type=kind,
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=f"default: {f.default}",
            )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if hasattr(args, f.name)
    }
    return TrainConfig(**given)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megart train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        from megart.training.trainer import Trainer

        Trainer(config_from_args(args)).train()
    except (MegartError, ValueError) as e:
        print(f"megart train: error: {e}", file=sys.stderr)
        return 2
    return 0
