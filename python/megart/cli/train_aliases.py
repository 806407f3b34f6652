"""Megatron-LM's other spellings of what megart train does, accepted under Megatron's names: each
gives the config its megart spelling gives (tests/test_megatron_flag_refusals.py), and what they
cannot mean here is refused by name, as Megatron-LM refuses it or because megart would
otherwise ignore it.

- --use-rotary-position-embeddings: Megatron's older switch for --position-embedding-type rope.
- --no-position-embedding: deprecated in Megatron, which refuses it unless the position
  embedding is rope (that has no table, so it changes nothing); megart the same.
- --disable-X for megart's --no-X (Megatron generates both spellings from its config classes).
- --exit-signal SIGTERM: the signal --exit-signal-handler catches, Megatron's default and the
  only one megart catches.
- --dataloader-type single: Megatron's default sampler, whose samples megart's --data-order
  megatron gives (cyclic and external it has not).
- --use-dist-ckpt, --dist-ckpt-format, --ckpt-fully-parallel-save, --disable-msc: deprecated in
  Megatron-LM, where they have no effect (it says so when given); nor here.
- --moe-layer-recompute: deprecated in Megatron-LM for --recompute-granularity selective with
  "moe" added to --recompute-modules (core_attn where none are given), as Megatron-Core's
  config turns it; refused with --recompute-granularity full, as there.
- --openai-gelu: OpenAI's GeLU, the tanh approximation, which megart's GeLU always is (fused or
  not); Megatron-LM keeps the flag "for backward compatibility" and no longer reads it (its
  fused bias-GeLU is the tanh form, its unfused MLP F.gelu's exact erf form).
"""

from __future__ import annotations

import argparse
from typing import Any

from megart.errors import ConfigError

# megart's --no-X switches (TrainConfig fields) that Megatron also spells --disable-X.
DISABLE_SPELLING = ("manual_gc_eval",)
# Megatron-LM's deprecated flags that have no effect there: (values taken, help).
# --openai-gelu is kept there for backward compatibility, unread.
DEPRECATED_NO_OPS = {
    "--use-dist-ckpt": (0, "deprecated in Megatron-LM, where it has no effect (--ckpt-format "
                        "picks the format); nor here"),
    "--dist-ckpt-format": (1, "deprecated in Megatron-LM, where it has no effect "
                           "(--ckpt-format picks the format); nor here"),
    "--ckpt-fully-parallel-save": (0, "deprecated in Megatron-LM, where it has no effect "
                                   "(saving in parallel is its default); nor here"),
    "--disable-msc": (0, "deprecated in Megatron-LM, where it has no effect (MultiStorageClient "
                      "is off by default); megart has none"),
    "--openai-gelu": (0, "OpenAI's GeLU (the tanh approximation), which megart's GeLU always "
                      "is; Megatron-LM no longer reads it"),
}  # fmt: skip


def add_alias_arguments(p: argparse.ArgumentParser) -> None:
    """Megatron's other spellings (the module's docstring says what each means here)."""
    p.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        default=argparse.SUPPRESS,
        help="Megatron-LM's older spelling of --position-embedding-type rope",
    )
    p.add_argument(
        "--no-position-embedding",
        action="store_true",
        default=argparse.SUPPRESS,
        help="Megatron-LM's deprecated switch: with --position-embedding-type rope it changes "
        "nothing (rope has no table); refused otherwise, as Megatron-LM refuses it",
    )
    p.add_argument(
        "--exit-signal",
        default=argparse.SUPPRESS,
        metavar="SIGNAL",
        help="SIGTERM only: the signal --exit-signal-handler catches (Megatron-LM's default)",
    )
    p.add_argument(
        "--dataloader-type",
        default=argparse.SUPPRESS,
        metavar="TYPE",
        help="single only, with --data-order megatron, whose samples are Megatron-LM's single "
        "sampler's (its default); cyclic and external are refused",
    )
    p.add_argument(
        "--moe-layer-recompute",
        action="store_true",
        default=argparse.SUPPRESS,
        help="Megatron-LM's deprecated spelling of --recompute-granularity selective with moe "
        "added to --recompute-modules (default core_attn)",
    )
    for flag, (nargs, meaning) in DEPRECATED_NO_OPS.items():
        dest = "deprecated_" + flag[2:].replace("-", "_")
        if nargs:
            p.add_argument(
                flag, dest=dest, default=argparse.SUPPRESS, metavar="FORMAT", help=meaning
            )
        else:
            p.add_argument(
                flag, dest=dest, action="store_true", default=argparse.SUPPRESS, help=meaning
            )


def apply_aliases(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """Turns the aliases in ``args`` into their megart spellings in ``given`` (TrainConfig's
    keyword arguments from the command line), refusing what they cannot mean here."""
    if hasattr(args, "use_rotary_position_embeddings"):
        kind = given.get("position_embedding_type", "rope")
        if kind != "rope":
            raise ConfigError(
                f"--use-rotary-position-embeddings with --position-embedding-type {kind}: the "
                "switch means --position-embedding-type rope; give one of them"
            )
        given["position_embedding_type"] = "rope"
    if hasattr(args, "moe_layer_recompute"):
        if given.get("recompute_granularity") == "full":
            raise ConfigError(
                "--moe-layer-recompute with --recompute-granularity full: the flag means "
                "selective recomputation of the MoE layers (as Megatron-LM refuses it); give "
                "one of them"
            )
        modules = list(given.get("recompute_modules") or ["core_attn"])  # Megatron's default
        given["recompute_granularity"] = "selective"
        given["recompute_modules"] = modules + ["moe"] * ("moe" not in modules)
    signal = getattr(args, "exit_signal", "SIGTERM")
    if signal != "SIGTERM":
        raise ConfigError(
            f"--exit-signal {signal}: megart's --exit-signal-handler catches SIGTERM only "
            "(Megatron-LM's default); give SIGTERM or leave it out"
        )
    sampler = getattr(args, "dataloader_type", None)
    if sampler not in (None, "single"):
        raise ConfigError(
            f"--dataloader-type {sampler}: megart has Megatron-LM's single sampler only (with "
            "--data-order megatron); leave it out"
        )
    if sampler == "single" and given.get("data_order") != "megatron":
        raise ConfigError(
            "--dataloader-type single: Megatron-LM's single sampler's samples are megart's "
            "with --data-order megatron (its default order is its own); add --data-order "
            "megatron"
        )


def check_no_position_embedding(args: argparse.Namespace, given: dict[str, Any]) -> None:
    """Megatron-LM's rule for --no-position-embedding, once the position embedding is known
    (after --use-checkpoint-args): with rope it changes nothing, otherwise it is refused."""
    from megart.training.config import TrainConfig

    kind = given.get("position_embedding_type", TrainConfig.position_embedding_type)
    if hasattr(args, "no_position_embedding") and kind != "rope":
        raise ConfigError(
            f"--no-position-embedding with --position-embedding-type {kind}: deprecated in "
            "Megatron-LM, which refuses it unless the position embedding is rope; give "
            "--position-embedding-type rope or leave it out"
        )
