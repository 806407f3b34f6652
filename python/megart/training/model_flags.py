"""How megart train's model flags (Megatron-LM's spellings, TrainConfig's fields) build the
model's GPTConfig, with Megatron's defaults where a flag is left out."""

from __future__ import annotations

from typing import Any

from megart.models.config import GPTConfig
from megart.training.config_checks import (
    NORMALIZATIONS,
    POSITION_EMBEDDING_TYPES,
    check_model_flags,
)


def gpt_config(config: Any) -> GPTConfig:
    """The model a TrainConfig's flags describe, Megatron's spellings mapped to GPTConfig's
    names; bad flag combinations are refused first, naming the flags."""
    check_model_flags(config)
    recompute = config.recompute_granularity or (
        "selective" if config.recompute_activations else None
    )
    return GPTConfig(
        vocab_size=config.vocab_size,
        seq_length=config.seq_length,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        ffn_hidden_size=config._ffn_hidden_size(),
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        layernorm_epsilon=config.layernorm_epsilon,
        normalization=NORMALIZATIONS[config.normalization],
        apply_layernorm_1p=config.apply_layernorm_1p,
        qk_layernorm=config.qk_layernorm,
        position_embedding=POSITION_EMBEDDING_TYPES[config.position_embedding_type],
        activation="swiglu" if config.swiglu else "gelu",
        bias=not config.disable_bias_linear,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        num_query_groups=config.num_query_groups if config.group_query_attention else None,
        rotary_base=float(config.rotary_base),
        rotary_interleaved=config.rotary_interleaved,
        rope_scaling=config.use_rope_scaling,
        rope_scaling_factor=float(config.rope_scaling_factor),
        rotary_seq_len_interpolation_factor=None
        if config.rotary_seq_len_interpolation_factor is None
        else float(config.rotary_seq_len_interpolation_factor),
        rotary_percent=float(config.rotary_percent),
        attention_backend=config.attention_backend,
        init_std=config.init_method_std,
        seed=config.seed,
        bias_gelu_fusion=_bias_gelu_fusion(config),
        fused_layer_norm=config.fused_layer_norm,
        cross_entropy_loss_fusion=config.cross_entropy_loss_fusion,
        fp32_residual_connection=config.fp32_residual_connection,
        recompute_granularity=recompute,
        recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
    )


def _bias_gelu_fusion(config: Any) -> bool:
    """Whether the MLP fuses its bias add and GeLU: as asked, else Megatron-LM's default,
    on unless there is no bias (it sets the fusion off then) or the MLP is SwiGLU (whose
    MLP never uses the GeLU fusion)."""
    if config.bias_gelu_fusion is not None:
        return config.bias_gelu_fusion
    return not (config.swiglu or config.disable_bias_linear)
