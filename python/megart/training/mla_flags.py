"""megart train's multi-latent attention flags (Megatron-LM's --multi-latent-attention,
--q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim and
--rope-type): TrainConfig's fields, and the GPTConfig fields they give (megart.models.mla)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megart.errors import ConfigError

ROPE_TYPES = ("rope", "yarn")  # Megatron-LM's --rope-type choices (MLA's rope)


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
    # otherwise (mla_yarn); "yarn" is MLA's only (Megatron-LM asserts so).
    rope_type: str | None = None


def mla_yarn(config: Any) -> bool:
    """Whether a TrainConfig's flags give multi-latent attention YaRN rope: under
    --multi-latent-attention, --rope-type yarn or none, as Megatron-LM's arguments leave
    MLATransformerConfig's default (yarn). Its settings are then --rotary-scaling-factor
    (1 by default: plain rope's angles, no mscale), --mscale and --mscale-all-dim; the
    original context and betas keep MLATransformerConfig's 4096, 32 and 1 (no Megatron-LM flag
    reaches them under MLA; megart takes --yarn-original-max-position-embeddings,
    --yarn-beta-fast and --yarn-beta-slow there too, where Megatron-LM would ignore them)."""
    return bool(config.multi_latent_attention) and config.rope_type != "rope"


def mla_fields(config: Any) -> dict[str, Any]:
    """GPTConfig's MLA fields from a TrainConfig's flags (YaRN's, mla_yarn, come from
    yarn_flags); refuses --rope-type yarn without MLA and --position-embedding-type yarn with
    it, as Megatron-LM does (an assertion; an MLA that refuses the GPT model's YaRN table)."""
    if config.rope_type == "yarn" and not config.multi_latent_attention:
        raise ConfigError(
            "--rope-type yarn without --multi-latent-attention: --rope-type picks multi-latent "
            "attention's rope (Megatron-LM asserts other attention takes --rope-type rope); "
            "other attention's YaRN is --position-embedding-type yarn"
        )
    if config.multi_latent_attention and config.position_embedding_type == "yarn":
        raise ConfigError(
            "--multi-latent-attention with --position-embedding-type yarn: multi-latent "
            "attention turns its own rope, YaRN by --rope-type yarn (or no --rope-type); "
            "Megatron-Core's GPTModel would build a second YaRN table, which its MLA refuses. "
            "Use --position-embedding-type rope"
        )
    names = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
             "qk_pos_emb_head_dim", "v_head_dim")  # fmt: skip
    return {n: getattr(config, n) for n in names}
