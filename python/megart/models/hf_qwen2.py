"""Hugging Face Qwen2 (``Qwen2ForCausalLM``, Qwen2 and Qwen2.5) as one of megart.models.hf's
formats.

A Qwen2 is a Llama (megart.models.hf_llama: RMSNorm, rope, SwiGLU, grouped-query attention, the
same tensor names and layouts) whose q_proj, k_proj and v_proj have biases and whose o_proj and
MLP have none: megart's --disable-bias-linear --add-qkv-bias (GPTConfig's bias=False,
add_qkv_bias=True). Llama's conversion both ways carries the q/k/v biases as it carries their
weights (fused per query group in megart, megart.models.hf_llama.fuse_qkv), so this module
adds only the config. What Qwen2's config can say and megart's GPT cannot (rope scaling other
than Llama's) is refused as for a Llama.

Qwen2's sliding window is Qwen3's, rule and fields alike (transformers 5's Qwen2Config and
Qwen3Config make the same layer_types from use_sliding_window, sliding_window and
max_window_layers, and both attentions mask with the same sliding-window mask): read and
written by megart.models.hf_qwen3's window and window_fields, as megart's --window-size W-1,0
with Megatron's per-layer --window-attn-skip-freq list where only some layers slide.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megart.models import hf_llama, hf_qwen3
from megart.models.config import GPTConfig, refuse_unlike
from megart.models.hf_llama import hf_tensors, to_megart  # the same names as Llama's

NAME = "Qwen2"
MODEL_TYPE = "qwen2"
FILE_PREFIX = ""
__all__ = ["check", "config_from_hf", "hf_config", "hf_tensors", "to_megart"]


def check(cfg: GPTConfig) -> None:
    """Refuses a model a Qwen2 checkpoint cannot represent: Llama's refusals, and linear biases
    other than exactly q/k/v's."""
    refuse_unlike(
        cfg,
        NAME,
        [
            *hf_llama.llama_style(cfg),
            ("qk_layernorm", cfg.qk_layernorm, False),
            ("bias", cfg.bias, False),
            ("add_qkv_bias", cfg.add_qkv_bias, True),
        ],
        "only models with RMSNorm, rotary positions, SwiGLU and biases on q/k/v alone "
        "(--disable-bias-linear --add-qkv-bias) can be written in its format",
    )
    hf_llama.check_rope(cfg, NAME)
    hf_llama.refuse_experts(cfg, NAME)


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """Llama's reading (hidden_act, a head_dim transformers' Qwen2 attention would read,
    rope and its scaling checked there), with q/k/v biases and Qwen2's sliding window."""
    layers = hf_qwen3.window(hf, NAME)
    # Qwen2ForCausalLM's q/k/v have biases and its o_proj and MLP none, whatever the config
    # says (Qwen2Config has no attention_bias or mlp_bias).
    cfg = hf_llama.config_from_hf({**hf, "attention_bias": False, "mlp_bias": False}, NAME)
    return dataclasses.replace(cfg, add_qkv_bias=True, **layers)


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """Qwen2's config.json: Llama's with Qwen2's type, without Llama's bias fields (Qwen2's
    biases are fixed), and its sliding-window fields (Qwen3's)."""
    out = hf_llama.hf_config(cfg)
    del out["attention_bias"], out["mlp_bias"]
    return {
        **out,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": MODEL_TYPE,
        **hf_qwen3.window_fields(cfg),
    }
