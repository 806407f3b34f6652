"""YaRN's flags (Megatron-LM's --position-embedding-type yarn and its settings): TrainConfig's
fields, the GPTConfig fields they give, and how Megatron-LM's args (its checkpoints') and
--use-checkpoint-args carry them. Megatron-LM spells three without "yarn": they are its
multi-latent attention's flags, which its GPT models' YaRN reads too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megart.errors import ConfigError
from megart.models.yarn import YarnConfig
from megart.training.mla_flags import mla_yarn

if TYPE_CHECKING:
    from megart.models.config import GPTConfig

# GPTConfig's field for each TrainConfig field (Megatron-LM's argparse name), and Megatron-LM's
# value for an unset flag: what its arguments give its YaRN (YarnConfig's defaults).
FIELDS = {
    "rotary_scaling_factor": "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "yarn_beta_fast": "yarn_beta_fast",
    "yarn_beta_slow": "yarn_beta_slow",
    "mscale": "yarn_mscale",
    "mscale_all_dim": "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int",
}
DEFAULTS = {flag: getattr(YarnConfig, field) for flag, field in FIELDS.items()}


@dataclass
class YarnFlags:
    """TrainConfig's YaRN flags, Megatron-LM's names and defaults (None: unset, YaRN's
    default applies); each applies only with --position-embedding-type yarn."""

    rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True


def yarn_fields(config: Any) -> dict[str, Any]:
    """GPTConfig's rope type and YaRN fields from a TrainConfig's flags (none without
    --position-embedding-type yarn, or multi-latent attention's --rope-type yarn (mla_yarn),
    where a setting given is refused by name: Megatron-LM ignores them there, megart refuses
    rather than ignore them)."""
    if config.position_embedding_type != "yarn" and not mla_yarn(config):
        given = [
            f"--{flag.replace('_', '-')} {getattr(config, flag)}"
            if not isinstance(getattr(config, flag), bool)
            else f"--no-{flag.replace('_', '-')}"
            for flag in FIELDS
            if getattr(config, flag) != YarnFlags.__dataclass_fields__[flag].default
        ]
        if given:
            raise ConfigError(
                f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} YaRN's rope "
                "scaling: add --position-embedding-type yarn (with --multi-latent-attention: "
                "--rope-type yarn) (Megatron-LM ignores it "
                "otherwise; megart refuses rather than ignore it) or leave it out"
            )
        return {}
    return _fields(lambda flag: getattr(config, flag))


def _fields(value_of: Callable[[str], Any]) -> dict[str, Any]:
    """GPTConfig's YaRN fields from ``value_of(flag)`` (None: unset, YaRN's default)."""
    out: dict[str, Any] = {"rope_type": "yarn"}
    for flag, field in FIELDS.items():
        value = value_of(flag)
        out[field] = type(DEFAULTS[flag])(DEFAULTS[flag] if value is None else value)
    return out


def yarn_args(cfg: GPTConfig) -> dict[str, Any]:
    """The YaRN flags of ``cfg`` as Megatron-LM's args hold them (its defaults, unset, without
    YaRN: there its rounding switch is unset too). Under multi-latent attention the --yarn-*
    ones are unset: its MLA reads only the other three (megatron_mla.MLA_YARN_ARGS)."""
    unset = {} if cfg.rope_type == "yarn" else {"yarn_correction_range_round_to_int": None}
    if cfg.multi_latent_attention:
        unset = {flag: None for flag in FIELDS if flag.startswith("yarn_")}
    return yarn_train_flags(cfg) | unset


def yarn_from_args(a: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's YaRN fields from Megatron-LM's args (``vars(args)``): none unless its
    --position-embedding-type is yarn; an unset (None) or absent setting is YaRN's default,
    as Megatron-LM's arguments give its GPT model."""
    return _fields(a.get) if a.get("position_embedding_type") == "yarn" else {}


def yarn_train_flags(cfg: GPTConfig) -> dict[str, Any]:
    """TrainConfig's YaRN flags that give ``cfg`` (their defaults without YaRN): what
    --use-checkpoint-args takes from a checkpoint."""
    if cfg.rope_type != "yarn":
        return {flag: YarnFlags.__dataclass_fields__[flag].default for flag in FIELDS}
    return {flag: getattr(cfg, field) for flag, field in FIELDS.items()}
