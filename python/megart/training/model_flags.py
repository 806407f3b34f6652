"""How megart train's model flags (Megatron-LM's spellings, TrainConfig's fields) build the
model's GPTConfig, with Megatron's defaults where a flag is left out."""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.models.config import (
    MEGATRON_NORMS,
    MEGATRON_POSITIONS,
    GPTConfig,
    activation_of,
    distinct_head_size,
)
from megart.models.moe_checks import capacity_factor
from megart.models.recompute import DEFAULT_MODULES, MODULES, OTHER_MODULES
from megart.models.window import parse_skip_freq, parse_window_size
from megart.parallel.layout import divisors, nearest_multiples
from megart.training.glu_flags import check_glu_flags, glu_fields
from megart.training.mla_flags import mla_fields
from megart.training.yarn_flags import yarn_fields

# Megatron's spellings of --normalization and --position-embedding-type, to GPTConfig's names.
NORMALIZATIONS = {flag: name for name, flag in MEGATRON_NORMS.items()}
POSITION_EMBEDDING_TYPES = {flag: name for name, flag in MEGATRON_POSITIONS.items()}
POSITION_EMBEDDING_TYPES["yarn"] = "rotary"  # rope with YaRN's frequencies (yarn_fields)


def gpt_config(config: Any) -> GPTConfig:
    """The model a TrainConfig's flags describe, Megatron's spellings mapped to GPTConfig's
    names; bad flag combinations are refused first, naming the flags."""
    check_model_flags(config)
    # --recompute-activations sets selective whatever --recompute-granularity says, as
    # Megatron-LM's validate_args does.
    recompute = "selective" if config.recompute_activations else config.recompute_granularity
    return GPTConfig(
        vocab_size=int(config.vocab_size),  # a plain int (megatron_flags.ResolvedVocabulary)
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
        activation=activation_of(config.swiglu, config.squared_relu, config.quick_geglu),
        **glu_fields(vars(config)),
        bias=not config.disable_bias_linear,
        add_qkv_bias=config.add_qkv_bias,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        num_query_groups=config.num_query_groups if config.group_query_attention else None,
        kv_channels=distinct_head_size(
            config.kv_channels, config.hidden_size, config.num_attention_heads
        ),
        rotary_base=float(config.rotary_base),
        rotary_interleaved=config.rotary_interleaved,
        rope_scaling=config.use_rope_scaling,
        rope_scaling_factor=float(config.rope_scaling_factor),
        rotary_seq_len_interpolation_factor=None
        if config.rotary_seq_len_interpolation_factor is None
        else float(config.rotary_seq_len_interpolation_factor),
        rotary_percent=float(config.rotary_percent),
        attention_backend=config.attention_backend,
        window_size=None if config.window_size is None else parse_window_size(config.window_size),
        window_attn_skip_freq=None
        if config.window_attn_skip_freq is None
        else parse_skip_freq(config.window_attn_skip_freq),
        cp_comm_type=config.cp_comm_type,
        softmax_type=config.softmax_type,
        init_std=config.init_method_std,
        init_method_xavier_uniform=config.init_method_xavier_uniform,
        seed=config.seed,
        bias_gelu_fusion=_bias_gelu_fusion(config),
        fused_layer_norm=config.fused_layer_norm,
        cross_entropy_loss_fusion=config.cross_entropy_loss_fusion,
        fp32_residual_connection=config.fp32_residual_connection,
        recompute_granularity=recompute,
        recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        recompute_modules=DEFAULT_MODULES
        if config.recompute_modules is None
        else tuple(dict.fromkeys(config.recompute_modules)),  # Megatron's list as a set
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        **moe_fields(config),
        **mla_fields(config),
        **yarn_fields(config),
        mtp_num_layers=config.mtp_num_layers,
        mtp_loss_scaling_factor=float(config.mtp_loss_scaling_factor),
    )


def moe_fields(config: Any) -> dict[str, Any]:
    """GPTConfig's MoE fields from a TrainConfig's flags (--num-experts 0 is none, as
    Megatron-LM reads it)."""
    freq = config.moe_layer_freq
    return dict(
        num_experts=config.num_experts or None,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        moe_layer_freq=1 if freq is None else parse_skip_freq(freq, "--moe-layer-freq"),
        moe_router_topk=config.moe_router_topk,
        moe_router_pre_softmax=config.moe_router_pre_softmax,
        moe_router_score_function=config.moe_router_score_function,
        moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
        moe_router_dtype=config.moe_router_dtype,
        moe_router_load_balancing_type=config.moe_router_load_balancing_type,
        moe_aux_loss_coeff=float(config.moe_aux_loss_coeff),
        moe_z_loss_coeff=config.moe_z_loss_coeff,
        moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=float(config.moe_router_bias_update_rate),
        moe_router_num_groups=config.moe_router_num_groups,
        moe_router_group_topk=config.moe_router_group_topk,
        moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=config.moe_shared_expert_gate,
        moe_expert_capacity_factor=capacity_factor(config.moe_expert_capacity_factor),
        moe_token_drop_policy=config.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=config.moe_pad_expert_input_to_capacity,
        moe_input_jitter_eps=config.moe_input_jitter_eps,
        moe_router_force_load_balancing=config.moe_router_force_load_balancing,
    )


def _bias_gelu_fusion(config: Any) -> bool:
    """Whether the MLP fuses its bias add and GeLU: as asked, else Megatron-LM's default,
    on unless there is no bias (it sets the fusion off then) or the MLP is SwiGLU (whose
    MLP never uses the GeLU fusion) or squared ReLU (which Megatron-Core cannot fuse: Megatron-LM
    fails there unless told --no-bias-gelu-fusion; megart leaves it off)."""
    if config.bias_gelu_fusion is not None:
        return config.bias_gelu_fusion
    return not (
        config.swiglu or config.squared_relu or config.quick_geglu or config.disable_bias_linear
    )


# The model's sizes: none can be 0 or negative (a model of no layers, no heads, an empty
# sequence or vocabulary would fail later in building it, or divide by zero).
SIZES = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")


def check_model_flags(cfg: Any) -> None:
    """Refuses architecture flags that cannot go together, naming them."""
    small = [f"--{n.replace('_', '-')} {getattr(cfg, n)}" for n in SIZES if getattr(cfg, n) < 1]
    if small:
        raise ConfigError(
            f"{' and '.join(small)}: the model's sizes must be at least 1; give "
            f"{'positive values' if len(small) > 1 else 'a positive value'}"
        )
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.kv_channels is not None and cfg.kv_channels < 1:
        raise ConfigError(f"--kv-channels {cfg.kv_channels}: a head is at least 1 wide")
    if h % heads and cfg.kv_channels is None:  # Megatron-LM's rule: --kv-channels is h / heads
        sizes = nearest_multiples(h, heads)
        fits = ", ".join(str(d) for d in divisors(h) if d <= 2 * heads)
        raise ConfigError(
            f"--hidden-size {h} does not split into --num-attention-heads {heads} heads of one "
            f"size: use a multiple of {heads} ({sizes}) or a head count that divides {h} ({fits})"
        )
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0 <= getattr(cfg, name) <= 1:  # also refuses NaN
            raise ConfigError(
                f"--{name.replace('_', '-')} {getattr(cfg, name):g} is a probability: give a "
                "value from 0 to 1 (Megatron-LM's default 0.1)"
            )
    for name, allowed in (
        ("normalization", NORMALIZATIONS),
        ("position_embedding_type", POSITION_EMBEDDING_TYPES),
        ("recompute_granularity", (None, "full", "selective")),
        ("recompute_method", ("uniform", "block")),
    ):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(
                f"--{name.replace('_', '-')} {getattr(cfg, name)!r}; use one of "
                f"{', '.join(a for a in allowed if a)} (Megatron-LM's spellings)"
            )
    if cfg.fused_layer_norm and cfg.normalization != "LayerNorm":
        raise ConfigError(
            f"--fused-layer-norm is a LayerNorm kernel: leave it out with --normalization "
            f"{cfg.normalization}"
        )
    if cfg.swiglu and cfg.squared_relu:
        raise ConfigError(
            "--swiglu and --squared-relu are two MLP activations: give one (Megatron-LM "
            "asserts it too)"
        )
    check_glu_flags(cfg)
    unfusable = ("swiglu", "squared_relu", "quick_geglu", "disable_bias_linear")
    unfusable = [f for f in unfusable if getattr(cfg, f)]
    if cfg.bias_gelu_fusion and unfusable:
        flags = " and ".join("--" + f.replace("_", "-") for f in unfusable)
        raise ConfigError(
            f"--bias-gelu-fusion fuses the MLP's bias add and GeLU: leave it out with {flags}"
        )
    _check_recompute_modules(cfg)
    if cfg.recompute_num_layers < 1:
        raise ConfigError(
            f"--recompute-num-layers {cfg.recompute_num_layers}: full recomputation's spans are "
            "at least 1 layer (uniform: layers per group; block: layers of each chunk "
            "replayed); give 1 or more"
        )
    ffn = cfg._ffn_hidden_size()
    if ffn is not None and ffn < 1:
        why = (
            ""
            if cfg.ffn_hidden_size is not None
            else (
                f" (--swiglu's default for --hidden-size {cfg.hidden_size}, Megatron's "
                "int(8h/3 / 64) * 64)"
            )
        )
        raise ConfigError(f"the MLP size {ffn}{why} must be positive; give --ffn-hidden-size")
    if ffn is not None and ffn % cfg.tp:
        raise ConfigError(
            f"the MLP size {ffn} (--ffn-hidden-size) does not split over "
            f"--tensor-model-parallel-size {cfg.tp}; use a multiple of {cfg.tp}"
        )
    _check_query_groups(cfg)
    head = cfg.kv_channels or cfg.hidden_size // max(1, cfg.num_attention_heads)
    # Under --rotary-percent below 1 only part of the head turns: GPTConfig checks that part.
    rope = cfg.position_embedding_type in ("rope", "yarn")
    if rope and head % 2 and cfg.rotary_percent == 1:
        width = (
            f"--kv-channels {head}"
            if cfg.kv_channels
            else f"--hidden-size {cfg.hidden_size} / --num-attention-heads "
            f"{cfg.num_attention_heads} = {head}"
        )
        raise ConfigError(
            f"--position-embedding-type {cfg.position_embedding_type} rotates pairs of a head's "
            "dimensions, but "
            f"{width} is odd; use an even head size"
        )
    if cfg.init_method_std < 0 or cfg.layernorm_epsilon <= 0:
        raise ConfigError(
            f"--init-method-std {cfg.init_method_std} must be at least 0 and "
            f"--layernorm-epsilon {cfg.layernorm_epsilon} positive"
        )


def _check_query_groups(cfg: Any) -> None:
    # max: a tensor-parallel size below 1 is check()'s to refuse, not a division by zero.
    groups, heads, tp = cfg.num_query_groups, cfg.num_attention_heads, max(1, cfg.tp)
    if not cfg.group_query_attention:
        if groups is not None:
            raise ConfigError(
                f"--num-query-groups {groups} is used only with --group-query-attention "
                "(as in Megatron-LM); add that flag, or leave --num-query-groups out for "
                "multi-head attention"
            )
        return
    if groups is None:
        raise ConfigError(
            "--group-query-attention needs --num-query-groups N, the number of key/value "
            "heads (Megatron-LM's default, 1, is multi-query attention: give 1 for that)"
        )
    if groups < 1 or heads % groups or groups % tp:
        fits = ", ".join(str(g) for g in divisors(heads) if g % tp == 0)
        raise ConfigError(
            f"--num-query-groups {groups} must divide --num-attention-heads {heads} and be "
            f"divisible by --tensor-model-parallel-size {tp} (each rank holds whole "
            "groups, as Megatron-LM requires); "
            + (f"use one of {fits}" if fits else "no group count fits: change the sizes")
        )


def _check_recompute_modules(cfg: Any) -> None:
    """--recompute-modules: only under selective recomputation (Megatron-LM ignores it
    otherwise; megart refuses rather than ignore it), and only the modules megart's dense
    layers have, each other one refused by name."""
    modules = cfg.recompute_modules
    if modules is None:
        return
    given = "--recompute-modules " + (" ".join(modules) if modules else "(none)")
    if not (cfg.recompute_activations or cfg.recompute_granularity == "selective"):
        why = "without recomputation" if cfg.recompute_granularity is None else (
            f"with --recompute-granularity {cfg.recompute_granularity}"
        )  # fmt: skip
        raise ConfigError(
            f"{given} {why}: the modules are what selective recomputation recomputes, and "
            "Megatron-LM ignores them otherwise (megart refuses rather than ignore them); add "
            "--recompute-granularity selective (or --recompute-activations), or leave it out"
        )
    refused = [f"{m} ({OTHER_MODULES[m]})" for m in dict.fromkeys(modules) if m in OTHER_MODULES]
    unknown = [m for m in dict.fromkeys(modules) if m not in MODULES and m not in OTHER_MODULES]
    if unknown:  # Megatron-Core asserts they are among its choices
        refused.append(f"{' '.join(unknown)} (not a module Megatron-LM recomputes)")
    if refused:
        raise ConfigError(
            f"--recompute-modules {'; '.join(refused)}: megart recomputes "
            f"{', '.join(MODULES)}; leave the others out"
        )
