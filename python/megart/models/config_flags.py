"""GPTConfig's fields as megart train's flags (Megatron-LM's spellings): the flags that give a
model's architecture, and the refusal of a model whose architecture a checkpoint format lacks,
naming them. Kept apart from the config itself, which re-exports these names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.errors import ConfigError
from megart.models.mla_checks import mla_flags
from megart.models.yarn import yarn_flags

if TYPE_CHECKING:
    from megart.models.config import GPTConfig

# Megatron-LM's spellings of GPTConfig's normalization and position_embedding (the values of
# megart train's --normalization and --position-embedding-type), by GPTConfig's names.
MEGATRON_NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
MEGATRON_POSITIONS = {"learned": "learned_absolute", "rotary": "rope"}


DENSE = "no --num-experts"  # every MoE entry of a dense model's architecture_flags
_ACTIVATION_FLAGS = {"swiglu": "--swiglu", "squared_relu": "--squared-relu",
                     "gelu": "neither --swiglu nor --squared-relu"}  # fmt: skip


def _activation_flags(cfg: GPTConfig) -> str:
    """The MLP's activation flags; quick GeGLU's offset and clamp change what its weights mean."""
    if cfg.activation != "quick_geglu":
        return _ACTIVATION_FLAGS[cfg.activation]
    clamp = cfg.activation_func_clamp_value
    return f"--quick-geglu --glu-linear-offset {cfg.glu_linear_offset:g}" + (
        "" if clamp is None else f" --activation-func-clamp-value {clamp:g}"
    )


def megatron_position(cfg: GPTConfig) -> str:
    """Megatron-LM's --position-embedding-type of ``cfg``: yarn for YaRN on the ordinary
    attention; multi-latent attention's YaRN is its --rope-type yarn, on rope."""
    if cfg.rope_type == "yarn" and not cfg.multi_latent_attention:
        return "yarn"
    return MEGATRON_POSITIONS[cfg.position_embedding]


def architecture_flags(cfg: GPTConfig) -> dict[str, str]:
    """The megart train flags (Megatron-LM's) that give ``cfg``'s architecture, by GPTConfig
    field ("no --disable-bias-linear" where a switch is off), so that messages about a model
    name what the user can change rather than GPTConfig's internal names."""
    position = megatron_position(cfg)
    return {
        "ffn_hidden_size": f"--ffn-hidden-size {cfg.ffn_size}",
        "normalization": f"--normalization {MEGATRON_NORMS[cfg.normalization]}",
        "position_embedding": f"--position-embedding-type {position}",
        "activation": _activation_flags(cfg),
        "bias": ("no " if cfg.bias else "") + "--disable-bias-linear",
        # Named apart only where it adds a bias (GPTConfig stores it False with biases on).
        "add_qkv_bias": ("" if cfg.add_qkv_bias else "no ") + "--add-qkv-bias",
        "layernorm_epsilon": f"--layernorm-epsilon {cfg.layernorm_epsilon:g}",
        # The same weights mean another scale with and without it.
        "apply_layernorm_1p": ("" if cfg.apply_layernorm_1p else "no ") + "--apply-layernorm-1p",
        "qk_layernorm": ("" if cfg.qk_layernorm else "no ") + "--qk-layernorm",
        "kv_channels": f"--kv-channels {cfg.head_dim}",
        # Rotary settings change what the weights mean only where there are rotary positions.
        # The factor is named only with the scaling on: without it, it changes nothing.
        "rotary": (
            f"--rotary-base {cfg.rotary_base:g}"
            + (" --rotary-interleaved" if cfg.rotary_interleaved else " (halves)")
            + (
                f" --use-rope-scaling --rope-scaling-factor {cfg.rope_scaling_factor:g}"
                if cfg.rope_scaling
                else ""
            )
            + (
                " --rotary-seq-len-interpolation-factor "
                f"{cfg.rotary_seq_len_interpolation_factor:g}"
                if cfg.rotary_seq_len_interpolation_factor is not None
                else ""
            )
            + (" " + yarn_flags(cfg) if cfg.rope_type == "yarn" else "")
            if cfg.position_embedding == "rotary"
            else "no rope"
        ),
        # Which channels of a head rope turns: the weights mean another thing under another.
        "rotary_percent": f"--rotary-percent {cfg.rotary_percent:g}",
        "untie_embeddings_and_output_weights": (
            "" if cfg.untie_embeddings_and_output_weights else "no "
        )
        + "--untie-embeddings-and-output-weights",
        # Keyed by the field, but one group per head is multi-head attention however given.
        "num_query_groups": (
            f"--group-query-attention --num-query-groups {cfg.query_groups}"
            if cfg.query_groups != cfg.num_attention_heads
            else "no --group-query-attention"
        ),
        "multi_latent_attention": mla_flags(cfg),  # MLA's widths, or none
        # The same weights under another normaliser (models.sinks).
        "softmax_type": f"--softmax-type {cfg.softmax_type}",
        **moe_flags(cfg),
    }


def moe_flags(cfg: GPTConfig) -> dict[str, str]:
    """architecture_flags' mixture-of-experts part: the experts, their width, which layers
    have them and how the router weighs them (its dtype and the training losses may change).
    A dense model's every entry is DENSE: a dense and an MoE model differ in num_experts, which
    names it (refuse_unlike and checkpoint loads leave the others out, see differing)."""
    fields = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk",
              "moe_router_pre_softmax", "moe_router_score_function",
              "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
              "moe_shared_expert_gate")  # fmt: skip
    if cfg.num_experts is None:
        return dict.fromkeys(fields, DENSE)
    factor, shared = cfg.moe_router_topk_scaling_factor, cfg.moe_shared_expert_intermediate_size
    # As the layers' 0/1 pattern: an N and the pattern it makes are one model.
    pattern = [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    return {
        "num_experts": f"--num-experts {cfg.num_experts}",
        "moe_ffn_hidden_size": f"--moe-ffn-hidden-size {cfg.moe_ffn_size}",
        "moe_layer_freq": f"--moe-layer-freq {pattern}",
        "moe_router_topk": f"--moe-router-topk {cfg.moe_router_topk}",
        "moe_router_pre_softmax": ("" if cfg.moe_router_pre_softmax else "no ")
        + "--moe-router-pre-softmax",
        "moe_router_score_function": "--moe-router-score-function " + cfg.moe_router_score_function,
        "moe_router_topk_scaling_factor": "no --moe-router-topk-scaling-factor"
        if factor is None
        else f"--moe-router-topk-scaling-factor {factor:g}",
        "moe_shared_expert_intermediate_size": "no --moe-shared-expert-intermediate-size"
        if shared is None
        else f"--moe-shared-expert-intermediate-size {shared}",
        "moe_shared_expert_gate": ("" if cfg.moe_shared_expert_gate else "no ")
        + "--moe-shared-expert-gate",
    }


def differing(was: dict[str, str], now: dict[str, str]) -> list[str]:
    """The architecture_flags fields whose texts differ between two models, ``was`` and
    ``now``; between a dense and an MoE model the MoE entries but num_experts left out (the
    dense one's are all DENSE)."""
    return [
        f for f in was if was[f] != now[f] and (f == "num_experts" or DENSE not in (was[f], now[f]))
    ]


def refuse_unlike(
    cfg: GPTConfig, fmt: str, fields: list[tuple[str, object, object]], closing: str
) -> None:
    """Refuses ``cfg`` for a checkpoint format ``fmt`` where a field's value differs from the
    format's, naming for each the megart train flag that gave it and the GPTConfig field;
    ``fields`` holds (field, the model's value, the format's), ``closing`` ends the message."""
    flags = architecture_flags(cfg)
    fields = [(n, v, t) for n, v, t in fields if n == "num_experts" or flags[n] != DENSE]
    unlike = [
        f"{flags[name]} ({name}={value!r}; {fmt} has {theirs!r})"
        for name, value, theirs in fields
        if value != theirs
    ]
    if unlike:
        raise ConfigError(f"a {fmt} checkpoint cannot represent {', '.join(unlike)}; {closing}")
