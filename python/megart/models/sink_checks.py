"""The checks of Megatron-LM's --softmax-type (attention sinks, megart.models.sinks), apart from
the attention so that GPTConfig imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.errors import ConfigError

if TYPE_CHECKING:
    from megart.models.config import GPTConfig

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_softmax_type(cfg: GPTConfig) -> None:
    """Refuses a --softmax-type megart does not have, or with a model it cannot take."""
    kind = cfg.softmax_type
    if kind not in SOFTMAX_TYPES:
        raise ConfigError(f"--softmax-type {kind}: use one of {', '.join(SOFTMAX_TYPES)}")
    if kind == "vanilla":
        return
    if cfg.multi_latent_attention:
        raise ConfigError(
            f"--softmax-type {kind} with --multi-latent-attention: megart's MLA core has no "
            "attention sink; drop one of them"
        )
    if kind == "learnable" and cfg.init_method_xavier_uniform:
        raise ConfigError(
            "--softmax-type learnable with --init-method-xavier-uniform: Glorot's bound needs "
            "two fans and the sink is one logit per head (Megatron-Core fails there too); drop "
            "--init-method-xavier-uniform"
        )


def refuse_sinks(kind: str, where: str) -> None:
    """Refuses attention sinks (--softmax-type ``kind``) for ``where``, a checkpoint format
    megart does not write them in: the model would load as another (vanilla softmax)."""
    if kind != "vanilla":
        raise ConfigError(
            f"a model with attention sinks (--softmax-type {kind}): megart does not write or "
            f"read them in {where}; keep it in megart's own checkpoint format (--ckpt-format "
            "megart)"
        )
