"""Hugging Face GPT-2 (``GPT2LMHeadModel``) as one of megart.models.hf's formats.

GPT-2 stores its linear layers as Conv1D ([in, out], y = x W + b) and its fused attention
projection as [q | k | v] along the output; megart stores [out, in] and groups the fused
projection per head ([q_i, k_i, v_i] for head i), so that a tensor-parallel slice holds whole
heads. Everything else maps one to one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.config import GPTConfig, refuse_unlike
from megart.models.hf_llama import refuse_experts

NAME = "GPT-2"
MODEL_TYPE = "gpt2"
FILE_PREFIX = "transformer."  # GPT2LMHeadModel's files; GPT2Model's have none


def _qkv_to_heads(w: torch.Tensor, heads: int) -> torch.Tensor:
    """[3h, ...] as [q | k | v] -> grouped per head."""
    return w.reshape(3, heads, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _qkv_from_heads(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _mapping(cfg: GPTConfig) -> list[tuple[str, str, str]]:
    """(megart name, GPT-2 name, conversion) for every parameter of a one-chunk GPT."""
    out = [
        ("chunk.wte.weight", "wte.weight", ""),
        ("chunk.wpe.weight", "wpe.weight", ""),
        ("chunk.ln_f.weight", "ln_f.weight", "norm"),
        ("chunk.ln_f.bias", "ln_f.bias", ""),
    ]
    for i in range(cfg.num_layers):
        m, g = f"chunk.blocks.{i}.", f"h.{i}."
        out += [
            (m + "ln_1.weight", g + "ln_1.weight", "norm"),
            (m + "ln_1.bias", g + "ln_1.bias", ""),
            (m + "ln_2.weight", g + "ln_2.weight", "norm"),
            (m + "ln_2.bias", g + "ln_2.bias", ""),
            (m + "attn.qkv.weight", g + "attn.c_attn.weight", "conv1d,qkv"),
            (m + "attn.qkv.bias", g + "attn.c_attn.bias", "qkv"),
            (m + "attn.proj.weight", g + "attn.c_proj.weight", "conv1d"),
            (m + "attn.proj.bias", g + "attn.c_proj.bias", ""),
            (m + "mlp.fc.weight", g + "mlp.c_fc.weight", "conv1d"),
            (m + "mlp.fc.bias", g + "mlp.c_fc.bias", ""),
            (m + "mlp.proj.weight", g + "mlp.c_proj.weight", "conv1d"),
            (m + "mlp.proj.bias", g + "mlp.c_proj.bias", ""),
        ]
    return out


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(
            f"GPT-2 activation {act!r} is not supported; megart's GPT uses GeLU "
            "with the tanh approximation (gelu_new)"
        )
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        seq_length=hf["n_positions"],
        hidden_size=hf["n_embd"],
        num_layers=hf["n_layer"],
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner"),  # None: 4 n_embd, as GPT-2
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
    )


def to_megart(
    cfg: GPTConfig, take: Callable[[str], torch.Tensor], wanted: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(megart parameter name, its whole tensor) one at a time, from ``take(name)``: GPT-2's
    tensor by its name without FILE_PREFIX (vocabulary unpadded). Only the names in
    ``wanted`` (default all) are converted, and only their GPT-2 tensors taken."""
    for ours, theirs, conv in _mapping(cfg):
        if wanted is not None and ours not in wanted:
            continue
        w = take(theirs)
        if "conv1d" in conv:
            w = w.t()
        if "qkv" in conv:
            w = _qkv_to_heads(w, cfg.num_attention_heads)
        yield ours, w


def check(cfg: GPTConfig) -> None:
    """Refuses a model that a GPT-2 checkpoint cannot represent, naming each option: the
    megart train flag that gave it and the GPTConfig field."""
    refuse_unlike(
        cfg,
        NAME,
        [
            ("normalization", cfg.normalization, "layernorm"),
            ("position_embedding", cfg.position_embedding, "learned"),
            ("activation", cfg.activation, "gelu"),
            ("bias", cfg.bias, True),
            ("add_qkv_bias", cfg.add_qkv_bias, False),  # a bias on q/k/v alone
            ("untie_embeddings_and_output_weights", cfg.untie_embeddings_and_output_weights, False),
            # GPT-2 has one key/value head per query head.
            ("num_query_groups", cfg.query_groups, cfg.num_attention_heads),
            ("rotary_percent", cfg.rotary_percent, 1.0),
            ("qk_layernorm", cfg.qk_layernorm, False),
            # GPT-2's heads are n_embd / n_head wide.
            ("kv_channels", cfg.kv_channels, None),
        ],
        "only models trained with GPT-2's own architecture can be written in its format",
    )
    cfg.refuse_window(NAME)
    refuse_experts(cfg, NAME)


def hf_tensors(
    cfg: GPTConfig, full: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-2's tensors, (name, tensor) one at a time, from ``full(name)``: the whole (not
    tensor-parallel) tensor of parameter ``name`` of a one-chunk GPT, vocabulary padding
    included. A writer holds only what it writes next; every rank calls ``full`` in
    ``_mapping`` order, which gathers across ranks rely on."""
    for ours, theirs, conv in _mapping(cfg):
        w = full(ours)
        if conv == "norm" and cfg.apply_layernorm_1p:
            w = w + 1  # GPT-2's LayerNorm holds the scale itself, not a zero-centred weight
        if theirs == "wte.weight":
            w = w[: cfg.vocab_size]
        if "qkv" in conv:
            w = _qkv_from_heads(w, cfg.num_attention_heads)
        if "conv1d" in conv:
            w = w.t()
        yield "transformer." + theirs, w


GPT2_EOD = 50256  # GPT-2's <|endoftext|>, GPT2Config's bos_token_id and eos_token_id


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """GPT-2's config.json for ``cfg``."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_length,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        # None is GPT-2's 4 n_embd; anything else must be written, or the MLP loads misshapen.
        "n_inner": None if cfg.ffn_size == 4 * cfg.hidden_size else cfg.ffn_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layernorm_epsilon,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        # GPT2Config's default bos/eos is GPT-2's <|endoftext|>, 50256: outside a smaller
        # vocabulary it is no token (transformers warns, and generation would stop at none).
        # An export with a tokenizer writes the tokenizer's ids over these.
        **({} if cfg.vocab_size > GPT2_EOD else {"bos_token_id": None, "eos_token_id": None}),
    }
