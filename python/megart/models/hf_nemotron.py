"""Hugging Face Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron) as one of
megart.models.hf's formats.

A Nemotron is megart's GPT with --squared-relu (transformers' ``relu2``), --apply-layernorm-1p
(its NemotronLayerNorm1P: LayerNorm with a bias and a zero-centred weight applied as 1 + w, the
very weights megart keeps, so they copy as they are), --position-embedding-type rope turning
the first --rotary-percent of each head (its partial_rotary_factor, rotating halves as
megart's default does), grouped-query attention and its own output layer. Its MLP is two
matrices (up_proj, down_proj: megart's ``mlp.fc`` and ``mlp.proj``); q, k and v are apart
(megart fuses them per query group: megart.models.hf_llama.split_qkv). Biases go on every
linear layer or none (attention_bias and mlp_bias together, as megart's --disable-bias-linear).
What its config can say and megart's GPT cannot (other activations, rope scaling) is refused
naming it; so is a megart model trained with --rotary-interleaved or rope scaling, which
Nemotron's rope does not spell.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.config import (
    GPTConfig,
    architecture_flags,
    refuse_unlike,
)
from megart.models.hf_llama import fuse_qkv, one_sided_bias, refuse_experts, sizes, split_qkv

NAME = "Nemotron"
MODEL_TYPE = "nemotron"
FILE_PREFIX = ""


def _pairs(cfg: GPTConfig) -> list[tuple[str, str]]:
    """(megart, Nemotron) names of every tensor other than the fused q/k/v's, in Nemotron's
    order: the embedding, per layer its norms and linear layers, the final norm, the output
    layer."""
    kinds = ["weight"] + ["bias"] * cfg.bias
    pairs = [("chunk.wte.weight", "model.embed_tokens.weight")]
    for i in range(cfg.num_layers):
        m, g = f"chunk.blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            pairs += [(f"{m}{ours}.{k}", f"{g}{theirs}.{k}") for k in ("weight", "bias")]
        for ours, theirs in (("attn.proj", "self_attn.o_proj"), ("mlp.fc", "mlp.up_proj"),
                             ("mlp.proj", "mlp.down_proj")):  # fmt: skip
            pairs += [(f"{m}{ours}.{k}", f"{g}{theirs}.{k}") for k in kinds]
    pairs += [(f"chunk.ln_f.{k}", f"model.norm.{k}") for k in ("weight", "bias")]
    if cfg.untie_embeddings_and_output_weights:
        pairs.append(("chunk.output_layer.weight", "lm_head.weight"))
    return pairs


def _qkv_names(cfg: GPTConfig, i: int) -> list[tuple[str, list[str]]]:
    """(megart's fused q/k/v tensor, Nemotron's q_proj, k_proj, v_proj) of layer i."""
    g = f"model.layers.{i}.self_attn."
    kinds = ["weight"] + ["bias"] * cfg.bias
    return [(f"chunk.blocks.{i}.attn.qkv.{k}", [f"{g}{x}_proj.{k}" for x in "qkv"]) for k in kinds]


def check(cfg: GPTConfig) -> None:
    """Refuses a model a Nemotron checkpoint cannot represent, naming each option."""
    refuse_unlike(
        cfg,
        NAME,
        [
            ("normalization", cfg.normalization, "layernorm"),
            ("apply_layernorm_1p", cfg.apply_layernorm_1p, True),
            ("position_embedding", cfg.position_embedding, "rotary"),
            ("activation", cfg.activation, "squared_relu"),
            ("qk_layernorm", cfg.qk_layernorm, False),
            ("add_qkv_bias", cfg.add_qkv_bias, False),
        ],
        "only models with zero-centred LayerNorm (--apply-layernorm-1p), rope and squared "
        "ReLU can be written in its format",
    )
    scaled = (
        cfg.rope_scaling
        or cfg.rotary_seq_len_interpolation_factor is not None
        or cfg.rope_type == "yarn"
    )
    if cfg.rotary_interleaved or scaled:
        raise ConfigError(
            f"a {NAME} checkpoint cannot represent {architecture_flags(cfg)['rotary']}: its "
            "rope rotates halves of the turning channels and scales nothing, so only a model "
            "trained without --rotary-interleaved and rope scaling can be written in its format"
        )
    cfg.refuse_window(NAME)
    refuse_experts(cfg, NAME)


def _rope(hf: dict[str, Any]) -> tuple[float, float, str]:
    """(rotary base, partial rotary factor, rope type) from a config.json of transformers 5
    (rope_parameters) or of earlier versions (top-level fields)."""
    params = hf.get("rope_parameters") or {}
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    return float(base), float(partial), kind


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    base, partial, kind = _rope(hf)
    problems = []
    if hf.get("hidden_act", "relu2") != "relu2":
        problems.append(f"hidden_act {hf['hidden_act']!r} (megart's --squared-relu is relu2)")
    if kind != "default":
        problems.append(f"rope type {kind!r} (megart reads Nemotron's unscaled rope)")
    problems += one_sided_bias(hf)
    if problems:
        raise ConfigError(
            f"this {NAME} has " + "; ".join(problems) + ", which megart's GPT cannot represent"
        )
    return GPTConfig(
        **sizes(hf),
        seq_length=hf.get("max_position_embeddings", 4096),
        layernorm_epsilon=hf.get("norm_eps", 1e-5),
        normalization="layernorm",
        apply_layernorm_1p=True,
        position_embedding="rotary",
        rotary_base=base,
        rotary_percent=partial,
        activation="squared_relu",
        bias=bool(hf.get("attention_bias", False)),
        # transformers' NemotronConfig unties by default.
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.0134),
    )


def to_megart(
    cfg: GPTConfig, take: Callable[[str], torch.Tensor], wanted: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(megart parameter name, its whole tensor) one at a time, from ``take(name)``: the
    Nemotron tensor of that name (vocabulary unpadded); only the names in ``wanted`` (default
    all) are converted."""
    for i in range(cfg.num_layers):
        for ours, theirs in _qkv_names(cfg, i):
            if wanted is None or ours in wanted:
                yield ours, fuse_qkv(cfg, *(take(name) for name in theirs))
    for ours, theirs in _pairs(cfg):
        if wanted is None or ours in wanted:
            yield ours, take(theirs)


def hf_tensors(
    cfg: GPTConfig, full: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Nemotron's tensors, (name, tensor) one at a time in its order, from ``full(name)``:
    the whole tensor of parameter ``name`` of a one-chunk GPT (megart.models.hf_llama's
    hf_tensors says how writers use it)."""
    qkv = {i: _qkv_names(cfg, i) for i in range(cfg.num_layers)}
    for ours, theirs in _pairs(cfg):
        tensor = full(ours)
        if ours in ("chunk.wte.weight", "chunk.output_layer.weight"):
            tensor = tensor[: cfg.vocab_size]
        yield theirs, tensor
        if theirs.endswith("input_layernorm.bias"):  # q, k, v come after the first norm
            for fused, names in qkv[int(theirs.split(".")[2])]:
                yield from zip(names, split_qkv(cfg, full(fused)), strict=True)


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """Nemotron's config.json for ``cfg``, readable by transformers 5 (rope_parameters) and by
    earlier versions (rope_theta, partial_rotary_factor)."""
    return {
        "architectures": ["NemotronForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "relu2",
        "max_position_embeddings": cfg.seq_length,
        "norm_eps": cfg.layernorm_epsilon,
        "rope_theta": cfg.rotary_base,
        "partial_rotary_factor": cfg.rotary_percent,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rotary_base,
            "partial_rotary_factor": cfg.rotary_percent,
        },
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }
