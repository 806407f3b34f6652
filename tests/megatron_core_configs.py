"""Megatron-Core's TransformerConfig fields for megart's mixture-of-experts and multi-latent
attention models (megatron_core_workers.megatron_model builds its model with them)."""

from __future__ import annotations

from megart.models import GPTConfig


def moe_config(cfg: GPTConfig) -> dict:
    """TransformerConfig's MoE fields for ``cfg`` (none without experts): megart's GPTConfig
    fields of the same names, SequentialMLP's experts (no grouped GEMM)."""
    if cfg.num_experts is None:
        return {}
    freq = cfg.moe_layer_freq
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.moe_ffn_size,
        moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
        moe_router_topk=cfg.moe_router_topk,
        moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_router_score_function=cfg.moe_router_score_function,
        moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
        moe_router_dtype=cfg.moe_router_dtype,
        moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff,
        moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
        moe_router_num_groups=cfg.moe_router_num_groups,
        moe_router_group_topk=cfg.moe_router_group_topk,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
        moe_token_drop_policy=cfg.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=cfg.moe_pad_expert_input_to_capacity,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
    )


def mla_config(cfg: GPTConfig) -> dict:
    """MLATransformerConfig's fields for ``cfg`` (none without multi-latent attention): the
    same names, megart's rope type and base, and YaRN's settings under its own names (its
    YarnRotaryEmbedding always rounds the correction range)."""
    if not cfg.multi_latent_attention:
        return {}
    names = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    yarn = dict(
        rotary_scaling_factor=cfg.yarn_rotary_scaling_factor,
        original_max_position_embeddings=cfg.yarn_original_max_position_embeddings,
        beta_fast=cfg.yarn_beta_fast,
        beta_slow=cfg.yarn_beta_slow,
        mscale=cfg.yarn_mscale,
        mscale_all_dim=cfg.yarn_mscale_all_dim,
    )
    return dict(
        {n: getattr(cfg, n) for n in names},
        rope_type=cfg.rope_type,
        rotary_base=cfg.rotary_base,
        **(yarn if cfg.rope_type == "yarn" else {}),
    )
