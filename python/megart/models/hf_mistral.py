"""Hugging Face Mistral (``MistralForCausalLM``) as one of megart.models.hf's formats: a Llama
(megart.models.hf_llama: the same tensor names and layouts, so the same conversion both ways)
without biases, with a sliding window over every layer.

transformers' Mistral (5.x) masks, in every layer, the keys at positions k <= q - sliding_window
(masking_utils' sliding_window_overlay keeps k > q - W): each token sees itself and W - 1
earlier tokens, Megatron's --window-size W-1,0 (megart.models.window). A Mistral with
sliding_window null (as from v0.2 on) is read as the Llama it is; megart writes a model without
a window as a Llama and one windowed in every layer as a Mistral. A window on some layers only
(--window-attn-skip-freq) has no Mistral spelling (a Qwen3's layer_types has one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megart.errors import ConfigError
from megart.models import hf_llama
from megart.models.config import GPTConfig, refuse_unlike
from megart.models.hf_llama import hf_tensors, to_megart  # the same names as Llama's

NAME = "Mistral"
MODEL_TYPE = "mistral"
FILE_PREFIX = ""
__all__ = ["check", "check_unbiased_llama", "config_from_hf", "hf_config", "hf_tensors",
           "refuse_some_windows", "to_megart", "window"]  # fmt: skip


def check(cfg: GPTConfig) -> None:
    """Refuses a model a Mistral checkpoint cannot represent: Llama's refusals, biases (its
    linear layers have none), and a window missing from some layer."""
    check_unbiased_llama(cfg, NAME)
    hf_llama.refuse_experts(cfg, NAME)
    if all(cfg.layer_window(i) is None for i in range(cfg.num_layers)):
        raise ConfigError(
            f"megart writes a {NAME} checkpoint only for a model with --window-size (its "
            "sliding window); this one has none, and is written as a Llama"
        )
    refuse_some_windows(cfg, NAME)


def check_unbiased_llama(cfg: GPTConfig, fmt: str) -> None:
    """Refuses for format ``fmt`` (Mistral's or Mixtral's) a model other than a Llama without
    biases or query/key norms, or with rope Llama's config cannot say."""
    refuse_unlike(
        cfg,
        fmt,
        [
            *hf_llama.llama_style(cfg),
            ("qk_layernorm", cfg.qk_layernorm, False),
            ("bias", cfg.bias, False),
            ("add_qkv_bias", cfg.add_qkv_bias, False),
        ],
        "only models with RMSNorm, rotary positions, SwiGLU and no linear biases can be "
        "written in its format",
    )
    hf_llama.check_rope(cfg, fmt)


def refuse_some_windows(cfg: GPTConfig, fmt: str) -> None:
    """Refuses a window on some layers only for format ``fmt``, whose sliding window (as
    Mistral's) applies to every layer or none."""
    full = [i + 1 for i in range(cfg.num_layers) if cfg.layer_window(i) is None]
    if full and len(full) < cfg.num_layers:
        raise ConfigError(
            f"a {fmt} checkpoint cannot represent --window-attn-skip-freq "
            f"{cfg.window_attn_skip_freq} (layers {full}, counted from 1, attend to the whole "
            f"sequence): {fmt}'s sliding window applies to every layer"
        )


def window(hf: dict[str, Any], fmt: str = NAME) -> dict[str, Any]:
    """GPTConfig's window_size for config.json's sliding_window as transformers' Mistral
    (and Mixtral) reads it: every layer windowed, or none where it is null; ``fmt`` names the
    format in the refusal."""
    # transformers' MistralForCausalLM windows every layer; it ignores layer_types (which
    # Ministral reads) and so does megart.
    size = hf.get("sliding_window")
    if size is None:
        return {}
    if type(size) is not int or size < 1:
        raise ConfigError(
            f"this {fmt} has sliding_window {size!r}: megart reads a window of at least one "
            "token (the token itself), or null for none"
        )
    return {"window_size": (size - 1, 0)}


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    # MistralForCausalLM's projections have no biases whatever attention_bias says.
    cfg = hf_llama.config_from_hf({**hf, "attention_bias": False, "mlp_bias": False}, NAME)
    return dataclasses.replace(cfg, **window(hf))


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """Mistral's config.json: Llama's with Mistral's type, no bias fields, and the window:
    megart's LEFT earlier tokens plus the token itself (check() has required a window in
    every layer)."""
    out = hf_llama.hf_config(cfg)
    del out["attention_bias"], out["mlp_bias"]
    assert cfg.window_size is not None
    return {
        **out,
        "architectures": ["MistralForCausalLM"],
        "model_type": MODEL_TYPE,
        "sliding_window": cfg.window_size[0] + 1,
    }
