"""megart train's multi-latent attention flags (Megatron-LM's --multi-latent-attention,
--q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim and
--rope-type): TrainConfig's fields, and the GPTConfig fields they give (megart.models.mla)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megart.errors import ConfigError

ROPE_TYPES = ("rope", "yarn")  # Megatron-LM's --rope-type choices; yarn is refused


@dataclass
class MLAFlags:
    """TrainConfig's MLA fields, Megatron-LM's flags and defaults (a mixin of TrainConfig)."""

    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected from h directly
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # Megatron-LM's None means YaRN under MLA (MLATransformerConfig's default) and plain rope
    # otherwise; megart builds plain rope only, so MLA needs "rope" given (mla_fields).
    rope_type: str | None = None


def mla_fields(config: Any) -> dict[str, Any]:
    """GPTConfig's MLA fields from a TrainConfig's flags; refuses YaRN, and MLA without
    --rope-type rope, whose absence means YaRN to Megatron-LM."""
    if config.rope_type == "yarn":
        raise ConfigError(
            "--rope-type yarn: megart's multi-latent attention turns plain rope only (its YaRN "
            "is the other attention's, --position-embedding-type yarn); use --rope-type rope"
        )
    if config.multi_latent_attention and config.rope_type != "rope":
        raise ConfigError(
            "--multi-latent-attention without --rope-type: Megatron-LM's MLA then turns YaRN "
            "rope (MLATransformerConfig's rope_type defaults to yarn), which megart does not "
            "build; add --rope-type rope for plain rope (megart's only kind), with "
            "--position-embedding-type rope"
        )
    names = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
             "qk_pos_emb_head_dim", "v_head_dim")  # fmt: skip
    return {n: getattr(config, n) for n in names}
