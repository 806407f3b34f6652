"""Megatron-LM's ``args`` (the argparse Namespace of its flags that every checkpoint holds):
the flags that describe a megart model and layout, and the model, layout and limits megart
reads from them. Used by the legacy files (megart.training.megatron_files) and the distributed
format (megart.training.megatron_dist) alike.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megart.errors import ConfigError
from megart.models.config import VOCAB_MULTIPLE, GPTConfig, activation_of, distinct_head_size
from megart.models.config_flags import megatron_position
from megart.models.moe_checks import capacity_factor
from megart.models.stages import check_stages, uneven
from megart.models.window import any_windowed
from megart.training.glu_flags import glu_args, glu_fields
from megart.training.megatron_mla import mla_args, mla_fields
from megart.training.megatron_mtp import mtp_args, mtp_fields
from megart.training.yarn_flags import yarn_args, yarn_from_args


def megatron_args(
    cfg: GPTConfig,
    iteration: int,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    first: int | None = None,
    last: int | None = None,
) -> argparse.Namespace:
    """The Megatron-LM flags (argparse names) that describe ``cfg`` on ``tp`` x ``pp`` ranks
    of ``vpp`` virtual stages each, the first/last stage holding ``first``/``last`` layers
    (Megatron-LM then takes interleaving as --num-virtual-stages-per-pipeline-rank only)."""
    per = cfg.num_layers // (pp * vpp) if vpp > 1 and not uneven(first, last) else None
    skip = cfg.window_attn_skip_freq
    windowed = any_windowed(cfg.window_size, skip, cfg.num_layers)
    return argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.seq_length,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=cfg.padded_vocab_size(tp),
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=cfg.layernorm_epsilon,
        # TransformerConfig's, which Megatron-LM's argparse takes as flags of the same names.
        init_method_std=cfg.init_std,
        init_method_xavier_uniform=cfg.init_method_xavier_uniform,
        apply_layernorm_1p=cfg.apply_layernorm_1p,
        qk_layernorm=cfg.qk_layernorm,
        position_embedding_type=megatron_position(cfg),
        **yarn_args(cfg),
        rotary_base=int(cfg.rotary_base),
        rotary_interleaved=cfg.rotary_interleaved,
        use_rope_scaling=cfg.rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        # Megatron-LM's flag is an integer: written as one where it is (megart takes any).
        rotary_seq_len_interpolation_factor=integral(cfg.rotary_seq_len_interpolation_factor),
        rotary_percent=cfg.rotary_percent,
        # As Megatron-LM's argparse gives them: a tuple, and an int or a list per layer. None
        # where no layer has a window (--window-size -1,0): Megatron-Core's local spec would
        # read (-1, 0) as a window that masks every key, Transformer Engine as none.
        softmax_type=cfg.softmax_type,  # (Megatron-LM's args have it from its config)
        window_size=cfg.window_size if windowed else None,
        window_attn_skip_freq=(list(skip) if isinstance(skip, tuple) else skip)
        if windowed
        else None,
        swiglu=cfg.activation == "swiglu",
        squared_relu=cfg.activation == "squared_relu",
        **glu_args(cfg),
        add_bias_linear=cfg.bias,
        # True with add_bias_linear too, as Megatron-LM's arguments keep the two in sync.
        add_qkv_bias=cfg.qkv_bias,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=per,
        num_virtual_stages_per_pipeline_rank=vpp if vpp > 1 and per is None else None,
        decoder_first_pipeline_num_layers=first,
        decoder_last_pipeline_num_layers=last,
        iteration=iteration,
        ckpt_format="torch",
        **moe_args(cfg),
        **mla_args(cfg),
        **mtp_args(cfg),
    )


def moe_args(cfg: GPTConfig) -> dict[str, Any]:
    """The mixture-of-experts flags of ``cfg`` as Megatron-LM 0.16's args hold them after its
    validate_args: num_experts None without experts (its --num-experts 0 too), and
    moe_ffn_hidden_size then None, else the experts' width (--ffn-hidden-size's where not
    given); --moe-layer-freq an int or a list of 0/1 per layer (its moe_freq_type);
    --moe-router-load-balancing-type and --moe-aux-loss-coeff (nargs "+") a single value, as
    validate_args leaves a list of one. No grouped GEMM (megart's experts are SequentialMLP's
    names) and no expert parallelism."""
    freq = cfg.moe_layer_freq
    return dict(
        num_experts=cfg.num_experts,
        moe_ffn_hidden_size=None if cfg.num_experts is None else cfg.moe_ffn_size,
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
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
        moe_token_drop_policy=cfg.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=cfg.moe_pad_expert_input_to_capacity,
        moe_input_jitter_eps=cfg.moe_input_jitter_eps,
        moe_router_force_load_balancing=cfg.moe_router_force_load_balancing,
        expert_model_parallel_size=1,
    )


def integral(x: float | None) -> float | int | None:
    """``x`` as an int where it is a whole number, else as it is: how Megatron-LM's integer
    flags take a float that megart allows (written in its args, or on a command line)."""
    return int(x) if x is not None and float(x).is_integer() else x


def config_from_args(a: dict[str, Any]) -> GPTConfig:
    """The GPTConfig Megatron-LM's flags (``vars(args)``) describe."""
    mla = mla_fields(a)  # first: what MLA's args hold that megart refuses, before any size
    rope = a.get("position_embedding_type") in ("rope", "yarn")
    # Under yarn Megatron-Core's YarnRotaryEmbedding ignores Llama 3's scaling, interpolation
    # and --rotary-percent (it turns whole heads): read as plain rope's only.
    plain = a.get("position_embedding_type") == "rope"
    # Megatron-LM's args from before it had the flags lack both: no scaling. Megatron ignores
    # them without rope (GPTConfig refuses that pair), and the factor without the scaling.
    scaled = plain and bool(a.get("use_rope_scaling", False))
    # Likewise absent from older args (no interpolation), and ignored by Megatron without rope.
    interpolation = a.get("rotary_seq_len_interpolation_factor") if plain else None
    return GPTConfig(
        vocab_size=a.get("vocab_size") or a["padded_vocab_size"],
        seq_length=a["seq_length"],
        hidden_size=a["hidden_size"],
        num_layers=a["num_layers"],
        num_attention_heads=a["num_attention_heads"],
        ffn_hidden_size=a.get("ffn_hidden_size"),
        layernorm_epsilon=a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5)),
        normalization="rmsnorm" if a.get("normalization") == "RMSNorm" else "layernorm",
        init_std=float(a.get("init_method_std", 0.02)),  # Megatron-LM's default where absent
        init_method_xavier_uniform=bool(a.get("init_method_xavier_uniform", False)),
        # Megatron-LM's argparse name; TransformerConfig's own name where args carry that.
        apply_layernorm_1p=bool(
            a.get("apply_layernorm_1p", a.get("layernorm_zero_centered_gamma", False))
        ),
        qk_layernorm=bool(a.get("qk_layernorm", False)),
        position_embedding="rotary" if rope else "learned",
        rotary_base=float(a.get("rotary_base", 10000)),
        rotary_interleaved=bool(a.get("rotary_interleaved", False)),
        rope_scaling=scaled,
        rope_scaling_factor=float(a.get("rope_scaling_factor", 8.0)) if scaled else 8.0,
        rotary_seq_len_interpolation_factor=None if interpolation is None else float(interpolation),
        # Megatron-LM's default 1.0 (whole heads) where older args lack it; ignored without rope.
        rotary_percent=float(a.get("rotary_percent", 1.0)) if plain else 1.0,
        window_size=a.get("window_size"),  # absent from older args: no window
        softmax_type=a.get("softmax_type", "vanilla"),  # likewise: the plain softmax
        window_attn_skip_freq=a.get("window_attn_skip_freq"),
        activation=activation_of(
            bool(a.get("swiglu")), bool(a.get("squared_relu")), bool(a.get("quick_geglu"))
        ),
        **glu_fields(a),
        bias=a.get("add_bias_linear", True),
        add_qkv_bias=bool(a.get("add_qkv_bias", False)),  # absent from older args: none
        untie_embeddings_and_output_weights=a.get("untie_embeddings_and_output_weights", False),
        num_query_groups=a.get("num_query_groups") if a.get("group_query_attention") else None,
        kv_channels=distinct_head_size(
            a.get("kv_channels"), a["hidden_size"], a["num_attention_heads"]
        ),
        make_vocab_size_divisible_by=a.get("make_vocab_size_divisible_by") or VOCAB_MULTIPLE,
        **moe_fields(a),
        **yarn_from_args(a),
        **mla,
        **mtp_fields(a),
    )


def moe_fields(a: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's mixture-of-experts fields from Megatron-LM's args (``vars``): none (a dense
    model) where they lack num_experts, as args from before Megatron had experts do, or hold
    None or 0 (its validate_args' None). A list of one where Megatron's nargs "+" flags are
    read before validate_args made them single values."""
    experts = a.get("num_experts") or None
    if experts is None:
        return {}

    def single(name: str, default: Any) -> Any:
        value = a.get(name, default)
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    width = a.get("moe_ffn_hidden_size")
    freq = a.get("moe_layer_freq", 1)
    return dict(
        num_experts=int(experts),
        # Written as --ffn-hidden-size's where validate_args filled it in: megart keeps None.
        moe_ffn_hidden_size=None if width == a.get("ffn_hidden_size") else width,
        moe_layer_freq=tuple(freq) if isinstance(freq, list) else freq,
        moe_router_topk=a.get("moe_router_topk", 2),
        moe_router_pre_softmax=bool(a.get("moe_router_pre_softmax", False)),
        moe_router_score_function=a.get("moe_router_score_function", "softmax"),
        moe_router_topk_scaling_factor=a.get("moe_router_topk_scaling_factor"),
        moe_router_dtype=a.get("moe_router_dtype"),
        moe_router_load_balancing_type=single("moe_router_load_balancing_type", "aux_loss"),
        moe_aux_loss_coeff=float(single("moe_aux_loss_coeff", 0.0)),
        moe_z_loss_coeff=a.get("moe_z_loss_coeff"),
        moe_router_enable_expert_bias=bool(a.get("moe_router_enable_expert_bias", False)),
        moe_router_bias_update_rate=float(a.get("moe_router_bias_update_rate", 1e-3)),
        moe_router_num_groups=a.get("moe_router_num_groups"),
        moe_router_group_topk=a.get("moe_router_group_topk"),
        moe_shared_expert_intermediate_size=a.get("moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(a.get("moe_shared_expert_gate", False)),  # older args lack it
        moe_expert_capacity_factor=capacity_factor(a.get("moe_expert_capacity_factor")),
        moe_token_drop_policy=a.get("moe_token_drop_policy", "probs"),
        moe_pad_expert_input_to_capacity=bool(a.get("moe_pad_expert_input_to_capacity", False)),
        moe_input_jitter_eps=a.get("moe_input_jitter_eps"),
        moe_router_force_load_balancing=bool(a.get("moe_router_force_load_balancing", False)),
    )


def saved_stages(a: dict[str, Any]) -> dict[str, int | None]:
    """The uneven first/last stages' layers Megatron-LM's args (``vars(args)``) record, as
    chunk_layers' ``first``/``last`` (None: even)."""
    return {
        "first": a.get("decoder_first_pipeline_num_layers"),
        "last": a.get("decoder_last_pipeline_num_layers"),
    }


# Megatron-LM's MoE flags that change the experts' parameters (names or kinds) from the ones
# megart has: grouped GEMM (TEGroupedMLP's weights).
MOE_UNBUILT = ("moe_grouped_gemm",)


def check_args(a: dict[str, Any], where: Any) -> None:
    """Refuses a Megatron-LM checkpoint (its ``vars(args)``) of what megart cannot represent
    (saves of any expert-parallel size are read, legacy files and torch_dist stores alike)."""
    stages = saved_stages(a)
    first, last = stages["first"], stages["last"]
    if uneven(first, last):  # Megatron-Core's placement of uneven stages (models.stages)
        vpp = a.get("virtual_pipeline_model_parallel_size") or 1
        try:
            check_stages(
                a["num_layers"], a.get("pipeline_model_parallel_size") or 1, vpp, first, last
            )
        except ConfigError as e:
            raise ConfigError(f"{where}: saved with {e}") from None
    # Other expert layouts than SequentialMLP's local_experts, with other parameter names.
    unlike = [f"--{k.replace('_', '-')}" for k in MOE_UNBUILT if a.get(k)]
    if unlike and a.get("num_experts"):
        raise ConfigError(
            f"{where}: a mixture-of-experts model saved with {', '.join(unlike)}, which megart "
            "does not have (its experts are Megatron-Core's SequentialMLP)"
        )


def args_record(a: dict[str, Any]) -> dict[str, Any]:
    """A megart file's ``config`` (model sizes and layout) and ``model_config`` as Megatron-LM's
    flags (``vars(args)``) give them."""
    cfg = config_from_args(a)
    tp, pp = a.get("tensor_model_parallel_size") or 1, a.get("pipeline_model_parallel_size") or 1
    vpp = a.get("virtual_pipeline_model_parallel_size") or 1
    per = a.get("num_layers_per_virtual_pipeline_stage") or (
        cfg.num_layers // (pp * vpp) if vpp > 1 else None  # uneven stages: marks interleaving
    )
    layout = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        seq_length=cfg.seq_length,
        # None where Megatron's tokenizer gave it (GPT2BPETokenizer, ...): the padded size
        # alone is known then, and checked against this run's instead.
        vocab_size=a.get("vocab_size"),
        padded_vocab_size=a.get("padded_vocab_size"),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layers_per_virtual_pipeline_stage=per,
        pipeline_schedule="1f1b" if per is None else "interleaved",
    )
    return {"config": layout, "model_config": dataclasses.asdict(cfg)}
