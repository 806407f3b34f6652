"""Hugging Face Qwen3 (``Qwen3ForCausalLM``) as one of megart.models.hf's formats.

A Qwen3 is a Llama (megart.models.hf_llama: RMSNorm, rope, SwiGLU, grouped-query attention)
with --qk-layernorm: each query and key head goes through an RMSNorm over its channels before
rope (Qwen3's ``self_attn.q_norm`` and ``k_norm``, megart's ``attn.q_layernorm`` and
``k_layernorm``), and no MLP bias. Everything else, names included, is Llama's, so this module
adds the two norms to Llama's conversion both ways; a head_dim other than hidden_size / heads
(as most Qwen3 checkpoints have) is megart's --kv-channels. What Qwen3's config can say and
megart's GPT cannot (rope scaling other than Llama's, say) is refused as for a Llama.

Qwen3's sliding window, as transformers 5 applies it: with use_sliding_window true, the layers
that layer_types marks "sliding_attention" (by default those numbered max_window_layers and
up, from 0) mask the keys at k <= q - sliding_window, as Mistral's (megart.models.hf_mistral):
megart's --window-size W-1,0 with --window-attn-skip-freq 1 on those layers and 0 (the whole
sequence) on the others, Megatron's list form; no list where every layer slides.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models import hf_llama
from megart.models.config import GPTConfig, refuse_unlike

NAME = "Qwen3"
MODEL_TYPE = "qwen3"
FILE_PREFIX = ""


def _qk_norm_names(i: int) -> list[tuple[str, str]]:
    """(megart, Qwen3) names of layer i's query and key norm weights."""
    m, g = f"chunk.blocks.{i}.attn.", f"model.layers.{i}.self_attn."
    return [(m + "q_layernorm.weight", g + "q_norm.weight"),
            (m + "k_layernorm.weight", g + "k_norm.weight")]  # fmt: skip


_AFTER = re.compile(r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight$")


def check(cfg: GPTConfig) -> None:
    """Refuses a model a Qwen3 checkpoint cannot represent: Llama's refusals, with query/key
    norms required and biases refused (Qwen3's MLP has none)."""
    check_qwen3_style(cfg, NAME)
    hf_llama.refuse_experts(cfg, NAME)


def check_qwen3_style(cfg: GPTConfig, fmt: str) -> None:
    """Refuses for format ``fmt`` (Qwen3's or Qwen3-MoE's) a model other than a Llama with
    query/key norms and no biases, or with rope Llama's config cannot say."""
    refuse_unlike(
        cfg,
        fmt,
        [
            *hf_llama.llama_style(cfg),
            ("qk_layernorm", cfg.qk_layernorm, True),
            ("bias", cfg.bias, False),
            ("add_qkv_bias", cfg.add_qkv_bias, False),
        ],
        "only models with RMSNorm, rotary positions, SwiGLU, query/key norms and no linear "
        "biases can be written in its format",
    )
    hf_llama.check_rope(cfg, fmt)


SLIDING, FULL = "sliding_attention", "full_attention"
MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default


def window(hf: dict[str, Any], fmt: str = NAME) -> dict[str, Any]:
    """GPTConfig's window_size and window_attn_skip_freq for Qwen3's window fields, read as
    transformers 5's Qwen3Config does (layer_types, which it saves, or else the layers from
    max_window_layers on); ``fmt``: the format whose fields these are (Qwen2's are the same)."""
    size = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", MAX_WINDOW_LAYERS)
        types = [SLIDING if size is not None and i >= first else FULL for i in range(n)]
    if len(types) != n or not set(types) <= {SLIDING, FULL}:
        raise ConfigError(
            f"this {fmt} has layer_types {types}: megart reads one {SLIDING!r} or {FULL!r} "
            f"per layer, {n} of them (num_hidden_layers)"
        )
    sliding = [t == SLIDING for t in types]
    if not any(sliding):
        return {}
    if size is None:  # transformers refuses it too (no window for those layers' mask)
        raise ConfigError(
            f"this {fmt} marks layers {SLIDING} in layer_types without a window "
            f"(use_sliding_window {hf.get('use_sliding_window')}, sliding_window "
            f"{hf.get('sliding_window')}): set both, or mark every layer {FULL}"
        )
    if type(size) is not int or size < 1:
        raise ConfigError(
            f"this {fmt} has sliding_window {size!r}: megart reads a window of at least one "
            "token (the token itself)"
        )
    pattern = None if all(sliding) else tuple(int(s) for s in sliding)
    return {"window_size": (size - 1, 0), "window_attn_skip_freq": pattern}


def window_fields(cfg: GPTConfig) -> dict[str, Any]:
    """Qwen3's window fields for ``cfg``: off without a window; otherwise layer_types from
    megart's per-layer windows, and max_window_layers the full-attention layers before the
    first windowed one (what versions of transformers without layer_types read)."""
    sliding = [cfg.layer_window(i) is not None for i in range(cfg.num_layers)]
    if not any(sliding):
        return {"use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.num_layers}  # fmt: skip
    assert cfg.window_size is not None
    return {
        "use_sliding_window": True,
        "sliding_window": cfg.window_size[0] + 1,
        "max_window_layers": sliding.index(True),
        "layer_types": [SLIDING if s else FULL for s in sliding],
    }


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    return dataclasses.replace(qwen3_style(hf, NAME), **window(hf))


def qwen3_style(hf: dict[str, Any], fmt: str) -> GPTConfig:
    """Llama's reading of a config of format ``fmt`` (Qwen3's or Qwen3-MoE's), with query/key
    norms and no biases (attention_bias refused: the MLP has none)."""
    if hf.get("attention_bias"):
        raise ConfigError(
            f"this {fmt} has attention_bias true with an MLP without biases, which megart's GPT "
            "cannot represent (--disable-bias-linear takes every linear layer's bias or none)"
        )
    cfg = hf_llama.config_from_hf({**hf, "attention_bias": False, "mlp_bias": False}, fmt)
    return dataclasses.replace(cfg, qk_layernorm=True)


def to_megart(
    cfg: GPTConfig,
    take: Callable[[str], torch.Tensor],
    wanted: Collection[str] | None = None,
    moe: hf_llama.MoeNames | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Llama's conversion (hf_llama.to_megart; MoE layers' names by ``moe``), then each
    layer's query and key norms."""
    yield from hf_llama.to_megart(cfg, take, wanted, moe)
    for i in range(cfg.num_layers):
        for ours, theirs in _qk_norm_names(i):
            if wanted is None or ours in wanted:
                yield ours, take(theirs)


def hf_tensors(
    cfg: GPTConfig, full: Callable[[str], torch.Tensor], moe: hf_llama.MoeNames | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Llama's tensors in its order (MoE layers' named by ``moe``), each layer's query and key
    norms after its o_proj (where Qwen3's attention registers them); zero-centred norm weights
    written as 1 + weight."""
    for name, tensor in hf_llama.hf_tensors(cfg, full, moe):
        yield name, tensor
        attention = _AFTER.match(name)
        if attention:
            for ours, theirs in _qk_norm_names(int(attention.group(1))):
                yield theirs, (full(ours) + 1 if cfg.apply_layernorm_1p else full(ours))


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """Qwen3's config.json: Llama's with Qwen3's type and its fields for the sliding window
    and biases (none)."""
    out = hf_llama.hf_config(cfg)
    del out["mlp_bias"]
    return {
        **out,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": MODEL_TYPE,
        **window_fields(cfg),
    }
