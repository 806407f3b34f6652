"""Multi-latent attention (megart.models.mla) in Megatron-LM's checkpoints: its flags in the
``args`` record both ways, and the names of its linear layers (each with an ``_extra_state``).

Megatron-LM's argparse names and defaults (its arguments.py and TransformerConfig, 0.16):
``multi_latent_attention`` (False), ``q_lora_rank`` (None), ``kv_lora_rank`` (32),
``qk_head_dim`` (128), ``qk_pos_emb_head_dim`` (64), ``v_head_dim`` (128) and ``rope_type``
(None, which MLA takes as YaRN). Its MLA's YaRN (core_transformer_config_from_args passes the
args whose names are MLATransformerConfig's fields) reads ``rotary_scaling_factor``, ``mscale``
and ``mscale_all_dim`` (and ``rotary_base``); its original context and betas stay
MLATransformerConfig's 4096, 32 and 1 and its correction range is rounded (no flag reaches
them: Megatron-LM's --yarn-* flags are its GPT model's YaRN's). megart writes MLA's YaRN so, and
refuses by name to write the settings of megart's MLA YaRN that Megatron-LM's cannot hold.

Megatron-Core's local layer spec (what megart's layer computes, and what its torch_dist keys
follow) keeps every MLA projection column-parallel, split on its rows, the down-projections
too, and its latent norms under their own names (``self_attention.q_layernorm``,
``self_attention.kv_layernorm``; the layer's ``input_layernorm`` and ``pre_mlp_layernorm`` too:
its MLA spec maps no key to Transformer Engine's fused names).
"""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.models.config import GPTConfig
from megart.models.mla_checks import MLA_DEFAULTS

# The MLA projections (Megatron-Core's module names in a layer), in the order MLASelfAttention
# registers them (linear_proj, a layer's first attention parameter, comes before them).
MLA_LINEARS = (
    "self_attention.linear_q_proj",
    "self_attention.linear_q_down_proj",
    "self_attention.linear_q_up_proj",
    "self_attention.linear_kv_down_proj",
    "self_attention.linear_kv_up_proj",
)
# q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim: the layer's widths.
_SIZES = tuple(MLA_DEFAULTS)


def mla_linears(cfg: GPTConfig) -> list[str]:
    """The MLA projections a layer of ``cfg`` has (queries projected directly or through a
    latent), in their registration order; none without MLA."""
    if not cfg.multi_latent_attention:
        return []
    unbuilt = MLA_LINEARS[1:3] if cfg.q_lora_rank is None else MLA_LINEARS[:1]
    return [n for n in MLA_LINEARS if n not in unbuilt]


def mla_args(cfg: GPTConfig) -> dict[str, Any]:
    """The MLA flags of ``cfg`` as Megatron-LM's args hold them (its defaults without MLA;
    YaRN's flags are megart.training.yarn_flags.yarn_args')."""
    if not cfg.multi_latent_attention:
        return dict(multi_latent_attention=False, rope_type=None, **MLA_DEFAULTS)
    return dict(
        multi_latent_attention=True,
        rope_type=cfg.rope_type,
        **{n: getattr(cfg, n) for n in _SIZES},
    )


# What Megatron-LM's MLA builds its YaRN with besides its flags: MLATransformerConfig's
# original_max_position_embeddings, beta_fast and beta_slow, and YarnRotaryEmbedding's rounding
# (MLA passes none). GPTConfig's field -> (that value, megart's flag that changes it).
MLA_YARN_FIXED = {
    "yarn_original_max_position_embeddings": (4096, "--yarn-original-max-position-embeddings"),
    "yarn_beta_fast": (32.0, "--yarn-beta-fast"),
    "yarn_beta_slow": (1.0, "--yarn-beta-slow"),
    "yarn_correction_range_round_to_int": (True, "--no-yarn-correction-range-round-to-int"),
}
# The args Megatron-LM's MLA takes its YaRN from (MLATransformerConfig's fields of those names,
# Megatron-LM's argparse defaults): GPTConfig's field, default.
MLA_YARN_ARGS = {
    "rotary_scaling_factor": ("yarn_rotary_scaling_factor", 1.0),
    "mscale": ("yarn_mscale", 1.0),
    "mscale_all_dim": ("yarn_mscale_all_dim", 0.0),
}


def refuse_mla_yarn(cfg: GPTConfig, where: str) -> None:
    """Refuses, for ``where`` (a Megatron-LM format), multi-latent attention's YaRN settings
    that Megatron-LM's MLA cannot hold (MLA_YARN_FIXED: megart applies its --yarn-* flags under
    MLA too, Megatron-LM's MLA keeps MLATransformerConfig's values)."""
    if not cfg.multi_latent_attention or cfg.rope_type != "yarn":
        return
    unheld = [(flag, f.removeprefix("yarn_"), getattr(cfg, f), v)
              for f, (v, flag) in MLA_YARN_FIXED.items() if getattr(cfg, f) != v]  # fmt: skip
    if unheld:
        given = " and ".join(f if isinstance(v, bool) else f"{f} {v}" for f, _, v, _ in unheld)
        kept = " and ".join(f"{name} {v}" for _, name, _, v in unheld)
        raise ConfigError(
            f"{given} with multi-latent attention's YaRN rope: {where} cannot hold it "
            f"(Megatron-LM's MLA keeps {kept}: no flag of its reaches them); leave it out, "
            "or keep megart's own checkpoint format (--ckpt-format megart)"
        )


def mla_fields(a: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's MLA fields from Megatron-LM's args (``vars``): none where they hold no MLA
    (older args lack the flags); with ``rope_type`` yarn or None (MLATransformerConfig's
    default, yarn) its YaRN as Megatron-LM's MLA builds it (MLA_YARN_ARGS, MLA_YARN_FIXED:
    its --yarn-* args do not reach it and are not read)."""
    if not a.get("multi_latent_attention"):
        return {}
    if a.get("position_embedding_type") == "yarn":
        raise ConfigError(
            "a Megatron-LM checkpoint with multi-latent attention and --position-embedding-type "
            "yarn: its GPT model's YaRN table beside MLA's own rope, which Megatron-Core's MLA "
            "refuses (MLA takes YaRN from --rope-type, on --position-embedding-type rope)"
        )
    rope = a.get("rope_type") or "yarn"
    scale, all_dim = float(a.get("rotary_scaling_factor", 1.0)), a.get("mscale_all_dim") or 0.0
    if rope == "rope" and scale > 1 and all_dim:  # its MLA scales its scores by YaRN's mscale
        raise ConfigError(
            f"a Megatron-LM checkpoint with multi-latent attention, --rope-type rope, "
            f"--rotary-scaling-factor {scale} and --mscale-all-dim {all_dim}: its scores are "
            "scaled by YaRN's mscale under plain rope, which megart does not build"
        )
    if a.get("mla_down_proj_fusion"):
        raise ConfigError(
            "a Megatron-LM checkpoint with multi-latent attention and --mla-down-proj-fusion "
            "(one fused linear_qkv_down_proj): megart builds the two down-projections apart"
        )
    yarn = {field: float(default if a.get(arg) is None else a[arg])
            for arg, (field, default) in MLA_YARN_ARGS.items()}  # fmt: skip
    yarn |= {field: value for field, (value, _) in MLA_YARN_FIXED.items()}
    return dict(
        multi_latent_attention=True,
        rope_type=rope,
        **{n: a.get(n, MLA_DEFAULTS[n]) for n in _SIZES},
        **(yarn if rope == "yarn" else {}),
    )


def mla_flags_from(cfg: GPTConfig) -> list[tuple[str, Any, bool]]:
    """--use-checkpoint-args' MLA flags of a checkpoint's ``cfg`` (TrainConfig field, value,
    forced): all forced, as megart's own rope and norm extras are (Megatron-LM's
    load_args_from_checkpoint takes none of them), so that the run builds the saved layers; a
    checkpoint without MLA turns it off and leaves the sizes to the command line."""
    if not cfg.multi_latent_attention:
        return [("multi_latent_attention", False, True)]
    flags = ("multi_latent_attention", "rope_type", *_SIZES)  # TrainConfig's (not YaRN's)
    return [(f, v, True) for f, v in mla_args(cfg).items() if f in flags]


# Transformer Engine's layer spec (Megatron-LM's default on GPUs) fuses MLA's latent norms into
# the up-projections and the pre-MLP norm into fc1, and keeps those names in its sharded keys
# (its MLA spec maps none back): the local spec's names -> its.
TE_MLA_NORMS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def te_key(key: str) -> str | None:
    """The torch_dist key under which Transformer Engine's MLA spec stores what the local
    spec stores under ``key`` (None where both name it alike)."""
    for local, fused in TE_MLA_NORMS.items():
        if f".{local}" in key:
            return key.replace(f".{local}", f".{fused}", 1)
    return None
