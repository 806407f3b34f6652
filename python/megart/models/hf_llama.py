"""Hugging Face Llama (``LlamaForCausalLM``) as one of megart.models.hf's formats; a Mistral
(``MistralForCausalLM``, megart.models.hf_mistral) has the same names and a sliding window.

A Llama is megart's GPT with --normalization RMSNorm, --position-embedding-type rope and
--swiglu; grouped-query attention, untied output weights, biases (Llama's attention_bias and
mlp_bias together), --rotary-base, --use-rope-scaling (Llama 3.x's, the rope type "llama3"),
--rotary-seq-len-interpolation-factor (the rope type "linear"; not together with
--use-rope-scaling, which no one rope type spells) and --apply-layernorm-1p all have a Llama
spelling. What differs is only where the weights sit:
- megart fuses q, k and v into one projection whose rows are grouped per query group, [q of
  the group's heads, k, v], so that a tensor-parallel slice holds whole groups; Llama keeps
  q_proj, k_proj and v_proj, each in head order (query head j uses key/value head j // (heads /
  groups) in both);
- megart's MLP has ``fc`` (Llama's up_proj), ``gate`` (gate_proj) and ``proj`` (down_proj);
- Llama rotates the halves of a head (x[i], x[i + d/2]), megart's default too. A model trained
  with --rotary-interleaved rotates adjacent pairs (x[2i], x[2i+1]); its q and k rows are
  reordered within each head on export, evens then odds, which turns pair (2i, 2i+1) into
  (i, i + d/2) at the same frequency, and leaves q . k unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.config import GPTConfig, distinct_head_size, refuse_unlike
from megart.models.hf_yarn import hf_yarn, yarn_from_hf
from megart.models.rope import (
    LLAMA3_HIGH_FREQ_FACTOR,
    LLAMA3_LOW_FREQ_FACTOR,
    LLAMA3_ORIGINAL_CONTEXT,
)

NAME = "Llama"
MODEL_TYPE = "llama"
FILE_PREFIX = ""


FINAL_NORM = ("chunk.ln_f.weight", "model.norm.weight")


def _norm_names(i: int) -> list[tuple[str, str]]:
    """(megart, Llama) names of layer i's two norm weights."""
    m, g = f"chunk.blocks.{i}.", f"model.layers.{i}."
    return [
        (m + "ln_1.weight", g + "input_layernorm.weight"),
        (m + "ln_2.weight", g + "post_attention_layernorm.weight"),
    ]


# A format's names of MoE layer i's router and experts: (megart, Hugging Face) pairs without
# ".weight" (megart's experts have no biases), for the families whose other tensors are
# Llama's (megart.models.hf_experts names them).
MoeNames = Callable[[int], list[tuple[str, str]]]


def _linear_names(cfg: GPTConfig, i: int, moe: MoeNames | None = None) -> list[tuple[str, str]]:
    """(megart, Llama) names of layer i's linear layers other than the fused q/k/v: an MoE
    layer's router and experts by ``moe`` where given."""
    m, g = f"chunk.blocks.{i}.", f"model.layers.{i}."
    attention = [(m + "attn.proj", g + "self_attn.o_proj")]
    if moe is not None and cfg.is_moe_layer(i):
        return attention + moe(i)
    return attention + [
        (m + "mlp.fc", g + "mlp.up_proj"),
        (m + "mlp.gate", g + "mlp.gate_proj"),
        (m + "mlp.proj", g + "mlp.down_proj"),
    ]


def refuse_experts(cfg: GPTConfig, fmt: str) -> None:
    """Refuses a model with experts for format ``fmt``, whose MLPs are dense."""
    if cfg.num_experts is not None:
        raise ConfigError(
            f"a {fmt} checkpoint cannot represent --num-experts {cfg.num_experts} (mixture-"
            f"of-experts layers; {fmt}'s MLPs are dense): only a model without experts can be "
            "written in its format (one with experts in every layer, as a Mixtral)"
        )


def split_qkv(cfg: GPTConfig, w: torch.Tensor) -> list[torch.Tensor]:
    """megart's fused rows (grouped per query group) -> [q_proj, k_proj, v_proj] rows."""
    groups, d = cfg.query_groups, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    q, k, v = w.reshape(groups, per_group + 2, d, *w.shape[1:]).split([per_group, 1, 1], dim=1)
    return [x.reshape(-1, *w.shape[1:]) for x in (q, k, v)]


def fuse_qkv(cfg: GPTConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    groups, d = cfg.query_groups, cfg.head_dim
    rest = q.shape[1:]
    parts = [x.reshape(groups, -1, d, *rest) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _kinds(cfg: GPTConfig) -> list[tuple[str, bool, bool]]:
    """(weight or bias, whether the fused q/k/v has one, whether the other linear layers
    do), in Hugging Face's order: q/k/v keep their bias alone under --add-qkv-bias."""
    return [("weight", True, True), ("bias", cfg.qkv_bias, cfg.bias)]


def _halves_order(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head reordered evens then odds: adjacent rotary pairs become halves."""
    heads = x.reshape(-1, head_dim, *x.shape[1:])
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return heads[:, order].reshape(x.shape)


def llama_style(cfg: GPTConfig) -> list[tuple[str, object, object]]:
    """(field, the model's value, Llama's) of what makes a model Llama-style, for
    refuse_unlike: RMSNorm, rotary positions and SwiGLU."""
    return [
        ("normalization", cfg.normalization, "rmsnorm"),
        ("position_embedding", cfg.position_embedding, "rotary"),
        ("activation", cfg.activation, "swiglu"),
    ]


def check(cfg: GPTConfig) -> None:
    """Refuses a model that a Llama checkpoint cannot represent, naming each option: the
    megart train flag that gave it and the GPTConfig field."""
    refuse_unlike(
        cfg,
        NAME,
        # Llama has no query/key norms (a Qwen3 is a Llama with them), and its attention_bias
        # gives o_proj a bias too: none on q/k/v alone (a Qwen2 is a Llama with that).
        [
            *llama_style(cfg),
            ("qk_layernorm", cfg.qk_layernorm, False),
            ("add_qkv_bias", cfg.add_qkv_bias, False),
        ],
        "only models with RMSNorm, rotary positions and SwiGLU can be written in its format",
    )
    check_rope(cfg, NAME)
    cfg.refuse_window(NAME)
    refuse_experts(cfg, NAME)


def check_rope(cfg: GPTConfig, fmt: str) -> None:
    """Refuses rope settings that Llama's config (and so format ``fmt``, which shares it)
    cannot say."""
    if cfg.rotary_percent != 1:
        # transformers' Llama turns every channel of a head (its cos and sin span head_dim).
        raise ConfigError(
            f"a {fmt} checkpoint cannot represent --rotary-percent {cfg.rotary_percent:g} "
            f"(rope turning {cfg.rotary_dim} of each head's {cfg.head_dim} channels): its rope "
            "turns the whole head, so only a model trained with --rotary-percent 1.0 (the "
            "default) can be written in its format"
        )
    if cfg.rope_scaling and cfg.rotary_seq_len_interpolation_factor is not None:
        # Hugging Face's config holds one rope type: "llama3" scales the frequencies, "linear"
        # divides the positions, and none does both, as Megatron-Core does when given both.
        raise ConfigError(
            f"a {fmt} checkpoint cannot represent --use-rope-scaling --rope-scaling-factor "
            f"{cfg.rope_scaling_factor:g} together with --rotary-seq-len-interpolation-factor "
            f"{cfg.rotary_seq_len_interpolation_factor:g} (Hugging Face's rope type is llama3 "
            "or linear, not both); only a model trained with one of them can be written in "
            "its format"
        )


# Hugging Face's "llama3" rope type with the constants megart's --use-rope-scaling fixes (as
# Megatron-Core does); only the factor varies.
LLAMA3_FIXED = {
    "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
    "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
    "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
}


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rotary base, rope scaling or None) from a config.json of transformers 5
    (rope_parameters) or of earlier versions (rope_theta, rope_scaling)."""
    params = hf.get("rope_parameters") or {}
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if "rope_type" in params else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(base), scaling


def _rope_scaling(
    scaling: dict[str, Any] | None, hf: dict[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """(GPTConfig's rope scaling fields, what megart cannot take) for Hugging Face's rope
    scaling of config ``hf``: its "llama3" type with Llama 3.x's constants is
    --use-rope-scaling, its "linear" type (positions divided by the factor)
    --rotary-seq-len-interpolation-factor, its "yarn" type --position-embedding-type yarn
    (megart.models.hf_yarn)."""
    if scaling is None:
        return {}, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return yarn_from_hf(scaling, hf)
    if kind == "linear" and scaling.get("factor") is not None:
        return {"rotary_seq_len_interpolation_factor": float(scaling["factor"])}, None
    fixed = {k: scaling.get(k) for k in LLAMA3_FIXED}
    if kind == "llama3" and fixed == LLAMA3_FIXED:
        return {"rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}, None
    why = (
        f"rope scaling {scaling} (megart's --use-rope-scaling is the llama3 rope type with "
        f"{LLAMA3_FIXED}, as Megatron-LM's, its --rotary-seq-len-interpolation-factor the "
        "linear type with a factor, and its --position-embedding-type yarn the yarn type)"
    )
    return {}, why


def sizes(hf: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's sizes from the fields the Llama family's configs (Nemotron's too) share:
    vocabulary, widths, layers, heads, key/value heads (grouped queries) and head_dim
    (--kv-channels where it is not hidden / heads, as Qwen3's usually is not)."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    groups = hf.get("num_key_value_heads") or heads
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=None if groups == heads else groups,
        kv_channels=distinct_head_size(hf.get("head_dim"), hidden, heads),
        ffn_hidden_size=hf["intermediate_size"],
    )


def one_sided_bias(hf: dict[str, Any]) -> list[str]:
    """What megart cannot represent of a config's attention_bias and mlp_bias: a bias on one
    side only (none when they agree)."""
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias == mlp_bias:
        return []
    return [
        f"attention_bias {attention_bias} with mlp_bias {mlp_bias} (megart's --disable-"
        "bias-linear takes every linear layer's bias or none)"
    ]


def config_from_hf(hf: dict[str, Any], fmt: str = NAME) -> GPTConfig:
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (megart's SwiGLU gates with silu)")
    problems += one_sided_bias(hf)
    base, scaling = _rope(hf)
    scaled, unsupported = _rope_scaling(scaling, hf)
    if unsupported:
        problems.append(unsupported)
    if problems:
        raise ConfigError(
            f"this {fmt} has " + "; ".join(problems) + ", which megart's GPT cannot represent"
        )
    return GPTConfig(
        **sizes(hf),
        # Rotary positions have no table: this is only the length megart trains with unless
        # told otherwise (import-hf --seq-length).
        seq_length=hf.get("max_position_embeddings", 2048),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        normalization="rmsnorm",
        position_embedding="rotary",
        rotary_base=base,
        **scaled,
        activation="swiglu",
        bias=bool(hf.get("attention_bias", False)),
        # transformers' LlamaConfig unties by default.
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
    )


def to_megart(
    cfg: GPTConfig,
    take: Callable[[str], torch.Tensor],
    wanted: Collection[str] | None = None,
    moe: MoeNames | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(megart parameter name, its whole tensor) one at a time, from ``take(name)``: the
    Llama tensor of that name (vocabulary unpadded). Only the names in ``wanted`` (default
    all) are converted, and only their Llama tensors taken; ``moe`` names MoE layers'."""
    pairs = [("chunk.wte.weight", "model.embed_tokens.weight")]
    for i in range(cfg.num_layers):
        pairs += _norm_names(i)
        g = f"model.layers.{i}.self_attn."
        for kind, qkv, others in _kinds(cfg):
            if qkv:
                ours = f"chunk.blocks.{i}.attn.qkv.{kind}"
                pairs.append((ours, [f"{g}{x}_proj.{kind}" for x in "qkv"]))
            if others:
                pairs += [(f"{m}.{kind}", f"{hf}.{kind}") for m, hf in _linear_names(cfg, i, moe)]
    pairs.append(FINAL_NORM)
    if cfg.untie_embeddings_and_output_weights:
        pairs.append(("chunk.output_layer.weight", "lm_head.weight"))
    for ours, theirs in pairs:
        if wanted is not None and ours not in wanted:
            continue
        if isinstance(theirs, list):  # q, k and v, fused
            yield ours, fuse_qkv(cfg, *(take(name) for name in theirs))
        else:
            yield ours, take(theirs)


def hf_tensors(
    cfg: GPTConfig, full: Callable[[str], torch.Tensor], moe: MoeNames | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Llama's tensors (MoE layers' named by ``moe``), (name, tensor) one at a time in Hugging
    Face's order (the embedding, layer by layer, the final norm, the output layer), from
    ``full(name)``: the whole (not tensor-parallel) tensor of parameter ``name`` of a one-chunk
    GPT, vocabulary padding included. A writer holds only what it writes next; every rank
    calls ``full`` in the same order, which gathers across ranks rely on."""

    def scale(name: str) -> torch.Tensor:
        # Llama's RMSNorm holds the scale itself, not a zero-centred weight.
        return full(name) + 1 if cfg.apply_layernorm_1p else full(name)

    yield "model.embed_tokens.weight", full("chunk.wte.weight")[: cfg.vocab_size]
    for i in range(cfg.num_layers):
        m, g = f"chunk.blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _norm_names(i):
            yield theirs, scale(ours)
        for kind, qkv, others in _kinds(cfg):
            if qkv:
                q, k, v = split_qkv(cfg, full(f"{m}attn.qkv.{kind}"))
                if cfg.rotary_interleaved:  # a bias's rows too: each is a head's channel
                    q, k = _halves_order(q, cfg.head_dim), _halves_order(k, cfg.head_dim)
                yield f"{g}self_attn.q_proj.{kind}", q
                yield f"{g}self_attn.k_proj.{kind}", k
                yield f"{g}self_attn.v_proj.{kind}", v
            for ours, theirs in _linear_names(cfg, i, moe) if others else ():
                yield f"{theirs}.{kind}", full(f"{ours}.{kind}")
    yield FINAL_NORM[1], scale(FINAL_NORM[0])
    if cfg.untie_embeddings_and_output_weights:
        yield "lm_head.weight", full("chunk.output_layer.weight")[: cfg.vocab_size]


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """Llama's config.json for ``cfg``, readable by transformers 5 (rope_parameters) and by
    earlier versions (rope_theta, rope_scaling)."""
    scaling = None
    if cfg.rope_scaling:
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, **LLAMA3_FIXED}
    elif cfg.rotary_seq_len_interpolation_factor is not None:  # check() refuses both
        scaling = {"rope_type": "linear", "factor": cfg.rotary_seq_len_interpolation_factor}
    elif cfg.rope_type == "yarn":  # GPTConfig refuses it beside the other two
        scaling = hf_yarn(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_length,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": cfg.rotary_base,
        "rope_scaling": scaling,
        "rope_parameters": {
            **(scaling or {"rope_type": "default"}),
            "rope_theta": cfg.rotary_base,
        },
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.attention_dropout,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }
