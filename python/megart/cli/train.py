"""megart train: trains GPT with Megatron-LM's flag names. With no arguments it trains a small
GPT on the built-in corpus (the Python standard library's sources, as bytes).

    megart train [--num-layers 4 --hidden-size 128 ...]
    torchrun --nproc-per-node 4 -m megart train --tensor-model-parallel-size 2 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

from megart.cli.train_aliases import (
    DISABLE_SPELLING,
    add_alias_arguments,
    apply_aliases,
    check_no_position_embedding,
)
from megart.cli.train_help import HELP
from megart.errors import ConfigError, MegartError
from megart.training.config import CHOICES, TrainConfig
from megart.training.megatron_flags import FUSIONS_OFF
from megart.training.megatron_refusals import refusal

# Other names Megatron-LM has used for a flag.
ALIASES = {
    "layernorm_epsilon": ["--norm-epsilon"],
    "override_opt_param_scheduler": ["--override-opt_param-scheduler"],  # Megatron's spelling
    "use_checkpoint_opt_param_scheduler": ["--use-checkpoint-opt_param-scheduler"],
}
# Flags that take a fixed number of values.
# --cp-comm-type takes Megatron's per-layer list too (one kind per layer); megart's layers all
# use one kind, so a list must repeat it (config_from_args).
NARGS = {"rampup_batch_size": 3, "cp_comm_type": "+"}
METAVARS = {"rampup_batch_size": ("START", "INCREMENT", "SAMPLES"), "recompute_modules": "MODULE"}
# Switches on by default in megart but off (or unset) in Megatron-LM: both spellings are
# accepted.
ON_BY_DEFAULT = ("overlap_grad_reduce", "yarn_correction_range_round_to_int")
# What each flag does (--help): megart.cli.train_help.HELP, one entry per TrainConfig field.


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, named as Megatron-LM names it (--hidden-size ...); a
    switch that is on by default is turned off with --no-NAME, as Megatron's are."""
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool) and f.default is True:
            spellings = ["--no-" + flag[2:]] + ["--disable-" + flag[2:]] * (
                f.name in DISABLE_SPELLING
            )
            p.add_argument(*spellings, dest=f.name, action="store_false", help=HELP[f.name])
            if f.name in ON_BY_DEFAULT:  # Megatron's switch for what megart does by default
                p.add_argument(flag, dest=f.name, action="store_true", help=argparse.SUPPRESS)
        elif f.type in ("bool", bool):
            spellings = [flag, *ALIASES.get(f.name, [])]
            p.add_argument(*spellings, dest=f.name, action="store_true", help=HELP[f.name])
        elif f.type == "bool | None":  # a switch whose default the config resolves: unset
            p.add_argument(
                flag,
                dest=f.name,
                action="store_true",
                default=argparse.SUPPRESS,
                help=HELP[f.name],
            )
        else:
            kind = {"int": int, "float": float, "list[int]": int}.get(
                str(f.type).split(" ")[0], str
            )
            choices = CHOICES.get(f.name)
            # A default of None is "unset": the help says what happens then.
            text = HELP[f.name] if f.default is None else f"{HELP[f.name]} (default: {f.default})"
            p.add_argument(
                flag,
                *ALIASES.get(f.name, []),
                dest=f.name,
                type=kind,
                nargs=NARGS.get(f.name, "+" if "list[" in str(f.type) else None),
                default=argparse.SUPPRESS,
                choices=choices,
                metavar=None if choices else METAVARS.get(f.name, f.name.upper()),
                help=text,
            )
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for flag, meaning in FUSIONS_OFF.items():
        # --no-bias-gelu-fusion sets megart's own switch (left unset when not given: the
        # config's default applies); the others have nothing to set.
        dest = flag[len("--no-") :].replace("-", "_")
        if dest in fields:
            p.add_argument(
                flag, dest=dest, action="store_false", default=argparse.SUPPRESS, help=meaning
            )
        else:
            p.add_argument(flag, dest="fusion_off", action="store_true", help=meaning)
    # Megatron-LM's: the model's flags from --load's checkpoint (megart.training.checkpoint_args).
    p.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="take the flags that define the model (sizes the command line leaves unset; the "
        "architecture and tokenizer always) from the latest checkpoint in --load",
    )
    p.add_argument(
        "--use-mp-args-from-checkpoint-args",
        action="store_true",
        help="with --use-checkpoint-args: also its tensor- and pipeline-parallel sizes, "
        "interleaving and uneven stages",
    )
    p.add_argument(
        "--no-use-tokenizer-model-from-checkpoint-args",
        "--disable-use-tokenizer-model-from-checkpoint-args",
        dest="use_tokenizer_model_from_checkpoint_args",
        action="store_false",
        help="with --use-checkpoint-args: not its tokenizer (type, model, vocab and merge "
        "files); give this run's",
    )
    add_alias_arguments(p)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    if hasattr(args, "train_iters") and getattr(args, "train_samples", None) is not None:
        raise ConfigError(
            "--train-iters and --train-samples exclude each other (as in Megatron-LM); give one"
        )
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if hasattr(args, f.name)
    }
    use = getattr(args, "use_checkpoint_args", False)
    mp = getattr(args, "use_mp_args_from_checkpoint_args", False)
    tokenizer = getattr(args, "use_tokenizer_model_from_checkpoint_args", True)
    if not use and (mp or not tokenizer):
        flag = "--use-mp-args" if mp else "--no-use-tokenizer-model"
        raise ConfigError(
            f"{flag}-from-checkpoint-args goes with --use-checkpoint-args: add it (Megatron-LM "
            "ignores it without; megart refuses rather than ignore it)"
        )
    if "cp_comm_type" in given:
        kinds = given["cp_comm_type"]
        if len(set(kinds)) > 1:
            raise ConfigError(
                f"--cp-comm-type {' '.join(kinds)}: megart's layers all exchange keys and "
                "values one way (Megatron's per-layer list is not built); give one kind"
            )
        given["cp_comm_type"] = kinds[0]
    apply_aliases(args, given)
    if use:  # before TrainConfig resolves the tokenizer's vocabulary and checks the layout
        from megart.training.checkpoint_args import apply

        given = apply(given, mp, tokenizer)
    check_no_position_embedding(args, given)
    selective = given.get("recompute_granularity") == "selective" or given.get(
        "recompute_activations"
    )
    spans = [
        f"--{name.replace('_', '-')} {getattr(args, name)}"
        for name in ("recompute_method", "recompute_num_layers")
        if getattr(args, name, None) is not None
    ]
    if selective and spans:
        # Megatron-LM refuses these too (its arguments and Megatron-Core's TransformerConfig):
        # selective checkpoints have no spans. megart's TrainConfig has defaults for both and
        # cannot tell a flag from them, so the command line is read here.
        raise ConfigError(
            f"{' and '.join(spans)} with selective recomputation (--recompute-granularity "
            "selective or --recompute-activations): Megatron-LM refuses them there; leave them "
            "out, or use --recompute-granularity full"
        )
    return TrainConfig(**given)


class FlagParser(argparse.ArgumentParser):
    """argparse, except that a bad flag is a ConfigError of one line (with the closest flag's
    name for a misspelt one) instead of a usage message of some 70 lines, so that it is said
    once across ranks and reaches torchrun's report (megart.cli.failure) like other errors.
    Megatron-LM's flags that megart cannot honour are refused by name, with why
    (megart.training.megatron_refusals). As Megatron-LM's parser, it takes no abbreviated
    flag (one of Megatron's could otherwise be read as a longer megart flag it begins)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        hints = []
        if message.startswith("unrecognized arguments:"):
            given = message.split(":", 1)[1].split()
            names = dict.fromkeys(w.split("=")[0] for w in given if w.startswith("--"))
            refused = [why for why in map(refusal, names) if why]
            others = [w for w in names if not refusal(w)]
            flags = [a for a in self._option_string_actions if a.startswith("--")]
            for word in others:
                close = difflib.get_close_matches(word, flags, n=1)
                if close:
                    hints.append(f"{word}: did you mean {close[0]}?")
            if refused:  # Megatron's flags that megart cannot honour: each named, with why
                rest = f"; unrecognized: {', '.join(others)}" if others else ""
                rest += f" ({'; '.join(hints)})" if hints else ""
                raise ConfigError("; ".join(refused) + rest)
        hints.append(f"'{self.prog} --help' lists the flags")
        raise ConfigError(f"{message} ({'; '.join(hints)})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = FlagParser(
        prog="megart train", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
        from megart.training.trainer import Trainer

        config = config_from_args(args)
        import megart.distributed as dist

        joined_here = not dist.is_initialized()
        Trainer(config).train()
        if joined_here:
            # Ended here rather than by the interpreter's shutdown, where a torch.distributed
            # group (--distributed-backend torch) can abort a process that finished cleanly.
            dist.destroy()
    except (MegartError, ValueError) as e:
        # Once for a configuration error (every rank finds it alike), with the same status on
        # every rank, and readable under torchrun: see megart.cli.failure.
        from megart.cli.failure import exit_on_error

        return exit_on_error("megart train", e)
    return 0
