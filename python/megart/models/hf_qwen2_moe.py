"""Hugging Face Qwen2-MoE (``Qwen2MoeForCausalLM``, Qwen1.5-MoE and Qwen2-57B-A14B) as one of
megart.models.hf's formats.

A Qwen2-MoE is a Qwen2 (megart.models.hf_qwen2: Llama's names and layouts, no MLP or o_proj
bias) whose q/k/v biases follow qkv_bias (megart's --add-qkv-bias, Qwen2's always on) and whose
MLPs are Qwen3-MoE's mixtures of experts (megart.models.hf_qwen3_moe: --num-experts routed by
norm_topk_prob, on the layers decoder_sparse_step and mlp_only_layers give them, in the same
per-expert files) plus a shared expert in every MoE layer: megart's
--moe-shared-expert-intermediate-size (shared_expert_intermediate_size), a SwiGLU MLP every token
goes through (``mlp.shared_expert.gate_proj``, ``up_proj``, ``down_proj``: megart's
``mlp.shared_experts.gate``, ``fc``, ``proj``), its output times sigmoid(x . w) with
``mlp.shared_expert_gate`` ([1, h], a Linear without bias), megart's --moe-shared-expert-gate
(``mlp.shared_expert_gate``): Megatron-Core's SharedExpertMLP with its gate, which Megatron's
Qwen2-MoE recipes use. transformers builds the shared expert and its gate in every MoE layer,
so a megart model is written in this format only with both, and a config without the shared
expert (shared_expert_intermediate_size 0) is refused.

The sliding window: transformers 5 windows the layers layer_types marks (which it saves), its
default for a config without them (every other layer below max_window_layers) being unlike
earlier versions': megart reads a window from layer_types only (Qwen2's reading, megart's
--window-size W-1,0 with the per-layer list), refuses use_sliding_window true without them,
and writes layer_types.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megart.errors import ConfigError
from megart.models import hf_experts, hf_llama, hf_qwen3, hf_qwen3_moe
from megart.models.config import GPTConfig, refuse_unlike

NAME = "Qwen2-MoE"
MODEL_TYPE = "qwen2_moe"
FILE_PREFIX = ""

# megart's shared experts' MLP -> Qwen2-MoE's shared_expert: Llama's MLP names.
SHARED_NAMES = hf_experts.LLAMA_MLP_NAMES
# transformers' Qwen2MoeConfig defaults, where a config.json leaves a field out.
DEFAULTS = dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                shared_expert_intermediate_size=5632, norm_topk_prob=False,
                decoder_sparse_step=1, qkv_bias=True)  # fmt: skip


def moe_names(cfg: GPTConfig) -> hf_llama.MoeNames:
    """Layer i's (megart, Qwen2-MoE) router, expert, shared expert and gate names, without
    ".weight"."""
    routed = hf_qwen3_moe.moe_names(cfg)

    def names(i: int) -> list[tuple[str, str]]:
        m, g = f"chunk.blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        shared = [
            (f"{m}shared_experts.{ours}", f"{g}shared_expert.{w}") for ours, w in SHARED_NAMES
        ]
        return [*routed(i), *shared, (m + "shared_expert_gate", g + "shared_expert_gate")]

    return names


def check(cfg: GPTConfig) -> None:
    """Refuses a model a Qwen2-MoE checkpoint cannot represent, naming each flag: a Llama
    other than one without biases but q/k/v's (either way) and without query/key norms, rope
    Llama's config cannot say, routing other than a softmax's, and MoE layers without a gated
    shared expert."""
    refuse_unlike(
        cfg,
        NAME,
        [
            *hf_llama.llama_style(cfg),
            ("qk_layernorm", cfg.qk_layernorm, False),
            ("bias", cfg.bias, False),
        ],
        "only models with RMSNorm, rotary positions, SwiGLU and no linear biases but q/k/v's "
        "(--add-qkv-bias or none) can be written in its format",
    )
    hf_llama.check_rope(cfg, NAME)
    hf_experts.require_experts(cfg, NAME, "a Llama or a Qwen2")
    unlike = hf_qwen3_moe.softmax_routing(cfg, NAME)
    built = f"{NAME} builds a shared expert with its sigmoid gate in every MoE layer"
    if cfg.moe_shared_expert_intermediate_size is None:
        unlike.append(("no --moe-shared-expert-intermediate-size", built))
    elif not cfg.moe_shared_expert_gate:
        unlike.append(("no --moe-shared-expert-gate", built))
    hf_experts.refuse_routing(unlike, NAME)


def window(hf: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's window fields from layer_types (the module's docstring)."""
    if hf.get("use_sliding_window") and hf.get("layer_types") is None:
        raise ConfigError(
            f"this {NAME} has use_sliding_window true without layer_types: transformers 5 "
            "windows every other layer below max_window_layers, earlier versions others, and "
            "megart does not guess which was meant; give layer_types (one 'sliding_attention' "
            "or 'full_attention' per layer) or use_sliding_window false"
        )
    return hf_qwen3.window(hf, NAME)


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """Llama's reading (sizes, rope and refusals) with q/k/v biases as qkv_bias says, the
    window, and Qwen3-MoE's experts plus the gated shared expert on the layers that have
    them."""
    # Qwen2MoeForCausalLM's o_proj and MLPs have no biases (its config has no field for them).
    cfg = hf_llama.config_from_hf({**hf, "attention_bias": False, "mlp_bias": False}, NAME)
    qkv_bias = bool(hf.get("qkv_bias", DEFAULTS["qkv_bias"]))
    cfg = dataclasses.replace(cfg, add_qkv_bias=qkv_bias, **window(hf))
    cfg = hf_qwen3_moe.with_experts(cfg, hf, NAME, DEFAULTS)
    if cfg.num_experts is None:  # a Qwen2 in all but name
        return cfg
    shared = hf.get("shared_expert_intermediate_size", DEFAULTS["shared_expert_intermediate_size"])
    if type(shared) is not int or shared < 1:
        raise ConfigError(
            f"this {NAME} has shared_expert_intermediate_size {shared!r}: transformers still "
            "builds the shared expert's gate, which megart's GPT cannot represent without "
            "shared experts (--moe-shared-expert-intermediate-size 1 or more)"
        )
    return dataclasses.replace(
        cfg, moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True
    )


# Llama's conversions with Qwen2-MoE's routers, experts and shared experts (all renamed, none
# reshaped).
to_megart, hf_tensors = hf_experts.conversions(hf_llama, moe_names)


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """Qwen2-MoE's config.json: Llama's without its bias fields, with qkv_bias, the experts
    (Qwen3-MoE's fields), the shared expert's width and the window's fields."""
    out = hf_llama.hf_config(cfg)
    del out["attention_bias"], out["mlp_bias"]
    return {
        **out,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": MODEL_TYPE,
        "qkv_bias": cfg.add_qkv_bias,
        **hf_qwen3_moe.expert_fields(cfg),
        "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
        **hf_qwen3.window_fields(cfg),
    }
