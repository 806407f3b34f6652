"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) as one of megart.models.hf's formats.

Attention is multi-latent (megart's --multi-latent-attention, models.mla): ``q_proj`` or, with
q_lora_rank, ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (megart's q_down_proj,
q_layernorm, q_up_proj), ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``
(kv_down_proj, kv_layernorm, kv_up_proj), ``o_proj`` (proj); qk_nope_head_dim is megart's
--qk-head-dim, qk_rope_head_dim its --qk-pos-emb-head-dim. transformers always builds the two
latent norms (megart's --qk-layernorm), RMSNorms whose epsilon is fixed at 1e-6 whatever
rms_norm_eps says, so megart (one epsilon for every norm) takes 1e-6 only. Each query head's
rows are its qk_nope_head_dim channels then its rope channels, and kv_a_proj_with_mqa's rows
the latent then the shared rope key part: megart's orders. With rope_interleave true (the
default, DeepSeek's checkpoints) transformers turns adjacent channel pairs (2i, 2i+1) by
frequency i (its output de-interleaved, evens then odds, in queries and keys alike: the same
scores), as megart's MLA (and Megatron-Core's) does, so the rows map as they are; with
rope_interleave false it turns halves (i, i + d/2), which is refused by name (the rows would
need reordering, which megart's import does not do).

Rope: rope_parameters' default type, or "yarn", which both turn qk_rope_head_dim channels.
transformers' DeepSeek scales the scores by yarn_get_mscale(factor, mscale_all_dim) squared
where mscale_all_dim is non-zero, as Megatron-Core's MLA (softmax_scale) does, and multiplies
cos and sin by its attention factor (models.hf_yarn's reading): megart's --mscale-all-dim is
mscale_all_dim, and its --mscale the one that gives that attention factor with it (the same
number where the config gives both, as DeepSeek-V3's does).

Experts: n_routed_experts SwiGLU experts of moe_intermediate_size in the layers from
first_k_dense_replace on (megart's --moe-layer-freq as a 0/1 list), the first ones dense of
intermediate_size; a shared expert of n_shared_experts x moe_intermediate_size, ungated
(--moe-shared-expert-intermediate-size). Its router (``mlp.gate``) takes sigmoid scores, adds
``e_score_correction_bias`` (a buffer: megart's expert bias, --moe-router-enable-expert-bias,
carried both ways) to choose, limits the choice to topk_group of n_group groups ranked by the
sum of each group's top 2 biased scores (Megatron-Core's --moe-router-num-groups and
--moe-router-group-topk rank by the top k / group_topk: the same where that is 2, or where every
group is kept), divides the k weights by their sum with norm_topk_prob (megart's sigmoid router
always does at k > 1, never at k = 1) and multiplies them by routed_scaling_factor
(--moe-router-topk-scaling-factor). Expert e's files are per expert (``mlp.experts.e.gate_proj``
...), the layout transformers 5 still writes and reads.

Multi-token prediction: num_nextn_predict_layers is megart's --mtp-num-layers, its layers read
and written by megart.models.hf_deepseek_v3_mtp (where the files hold them: fit_files).

Refused by name: topk_method other than noaux_tc,
scoring_func other than sigmoid, attention_bias, rope_interleave false, other rope types,
and what megart's routing cannot spell.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models import hf_deepseek_v3_mtp as mtp
from megart.models import hf_experts, hf_llama
from megart.models.config import GPTConfig
from megart.models.config_flags import refuse_unlike
from megart.models.hf_yarn import hf_yarn, yarn_from_hf
from megart.models.yarn import yarn_concentration, yarn_mscale

NAME = "DeepSeek-V3"
MODEL_TYPE = "deepseek_v3"
FILE_PREFIX = ""

# transformers' DeepseekV3Config defaults, where a config.json leaves a field out.
DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                n_shared_experts=1, first_k_dense_replace=3, norm_topk_prob=True, n_group=8,
                topk_group=4, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                rope_interleave=True, num_nextn_predict_layers=1)  # fmt: skip
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, its latent norms'
# megart's attention names -> DeepSeek-V3's, without ".weight"; the queries' by q_lora_rank.
ATTENTION = (("kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
             ("kv_up_proj", "kv_b_proj"), ("proj", "o_proj"))  # fmt: skip
QUERIES = (("q_proj", "q_proj"),)
QUERIES_LORA = (("q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
                ("q_up_proj", "q_b_proj"))  # fmt: skip
fit_files = mtp.fit_files  # models.hf's hook: the depths as the files hold them
SHARED = tuple(
    (f"shared_experts.{m}", f"shared_experts.{h}") for m, h in hf_experts.LLAMA_MLP_NAMES
)


def _field(hf: dict[str, Any], name: str) -> Any:
    """A DeepSeek-V3 field by transformers' name, its attribute_map's, or its default."""
    aliases = {
        "n_routed_experts": "num_local_experts",
        "num_nextn_predict_layers": "num_mtp_layers",
    }
    if name not in hf and aliases.get(name) in hf:
        return hf[aliases[name]]
    return hf.get(name, DEFAULTS[name])


def _yarn(scaling: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's YaRN fields for DeepSeek's yarn: the concentration transformers puts on
    cos and sin (hf_yarn's reading), with mscale_all_dim as the scores' mscale."""
    fields, why = yarn_from_hf(scaling, hf)
    if why:
        raise ConfigError(f"this {NAME} has {why}")
    f, a = fields["yarn_rotary_scaling_factor"], float(scaling.get("mscale_all_dim") or 0.0)
    m, read = fields["yarn_mscale"], fields["yarn_mscale_all_dim"]
    if read != a and f > 1:  # the --mscale giving transformers' concentration beside a
        concentration = yarn_concentration(f, m, read)
        m = (concentration * yarn_mscale(f, a) - 1) / (0.1 * math.log(f))
    return {**fields, "yarn_mscale": m, "yarn_mscale_all_dim": a}


def _experts(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """GPTConfig's MoE fields (none where no layer has experts)."""
    dense = _field(hf, "first_k_dense_replace")
    if dense >= layers:
        return {}
    k, groups, chosen = (_field(hf, n) for n in ("num_experts_per_tok", "n_group", "topk_group"))
    normalised, experts = bool(_field(hf, "norm_topk_prob")), _field(hf, "n_routed_experts")
    problems = []
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"topk_method {hf['topk_method']!r} (transformers routes as noaux_tc)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func {hf['scoring_func']!r} (transformers takes sigmoid)")
    if normalised != (k > 1):
        problems.append(
            f"norm_topk_prob {normalised} with num_experts_per_tok {k} (megart's sigmoid "
            "router, as Megatron-Core's, divides the weights by their sum exactly when k > 1)"
        )
    if chosen != groups and k != 2 * chosen:
        problems.append(
            f"n_group {groups} with topk_group {chosen} and num_experts_per_tok {k} "
            "(transformers ranks groups by their top 2 scores, Megatron-Core's group-limited "
            "routing by their top k / group_topk: the same only where that is 2)"
        )
    shared = _field(hf, "n_shared_experts")
    if shared < 1:
        problems.append(f"n_shared_experts {shared} (megart's shared experts have a width)")
    if problems:
        raise ConfigError(f"this {NAME} has {'; '.join(problems)}, which megart cannot represent")
    factor = float(_field(hf, "routed_scaling_factor"))
    return dict(
        num_experts=experts,
        moe_router_topk=k,
        moe_ffn_hidden_size=_field(hf, "moe_intermediate_size"),
        moe_layer_freq=1 if dense <= 0 else tuple(int(i >= dense) for i in range(layers)),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=None if chosen == groups else groups,
        moe_router_group_topk=None if chosen == groups else chosen,
        moe_router_topk_scaling_factor=None if factor == 1 else factor,
        moe_shared_expert_intermediate_size=shared * _field(hf, "moe_intermediate_size"),
    )


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """Llama's reading of the sizes, norms and rope base, with MLA, YaRN and the experts."""
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias true (megart's MLA projections have no bias)")
    if hf.get("rms_norm_eps", 1e-6) != LATENT_NORM_EPS:
        problems.append(
            f"rms_norm_eps {hf['rms_norm_eps']} (its latent norms' epsilon is 1e-6 whatever "
            "it says, and megart's norms share one)"
        )
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads") not in (None, heads):
        problems.append(f"num_key_value_heads {hf['num_key_value_heads']} (MLA: one per head)")
    base, scaling = hf_llama._rope(hf)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if not _field(hf, "rope_interleave"):
        problems.append(
            "rope_interleave false (rope on halves of the rope channels; megart's MLA, as "
            "DeepSeek's checkpoints and Megatron-Core, turns adjacent pairs)"
        )
    if kind not in (None, "yarn"):
        problems.append(f"rope scaling {scaling} (megart's MLA turns plain rope or yarn)")
    if problems:
        raise ConfigError(f"this {NAME} has {'; '.join(problems)}, which megart cannot represent")
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    cfg = hf_llama.config_from_hf({**plain, "rope_theta": base, "head_dim": None}, NAME)
    return dataclasses.replace(
        cfg,
        num_query_groups=None,
        kv_channels=None,
        qk_layernorm=True,
        multi_latent_attention=True,
        q_lora_rank=_field(hf, "q_lora_rank"),
        kv_lora_rank=_field(hf, "kv_lora_rank"),
        qk_head_dim=_field(hf, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_field(hf, "qk_rope_head_dim"),
        v_head_dim=_field(hf, "v_head_dim"),
        mtp_num_layers=_field(hf, "num_nextn_predict_layers") or None,  # the files decide
        **({"rope_type": "yarn", **_yarn(scaling, hf)} if kind == "yarn" else {}),
        **_experts(hf, hf["num_hidden_layers"]),
    )


def check(cfg: GPTConfig) -> None:
    """Refuses a model a DeepSeek-V3 checkpoint cannot represent, naming each flag."""
    if not cfg.multi_latent_attention:
        raise ConfigError(f"a {NAME} checkpoint holds multi-latent attention only")
    refuse_unlike(
        cfg,
        NAME,
        [*hf_llama.llama_style(cfg), ("qk_layernorm", cfg.qk_layernorm, True),
         ("bias", cfg.bias, False), ("layernorm_epsilon", cfg.layernorm_epsilon, 1e-6)],
        "its latent norms (epsilon 1e-6) are always there and none of its layers has a bias",
    )  # fmt: skip
    hf_llama.check_rope(cfg, NAME)
    cfg.refuse_window(NAME)
    mtp.check_depths(cfg)
    if cfg.num_experts is None:
        return
    pattern = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    first = pattern.index(True) if any(pattern) else cfg.num_layers
    k, groups = cfg.moe_router_topk, (cfg.moe_router_num_groups, cfg.moe_router_group_topk)
    shared, capacity = cfg.moe_shared_expert_intermediate_size, cfg.moe_expert_capacity_factor
    unlike = [
        (f"--moe-layer-freq {[int(p) for p in pattern]}" * (not all(pattern[first:])),
         f"{NAME}'s dense layers are its first ones (first_k_dense_replace)"),
        (f"--moe-router-score-function {cfg.moe_router_score_function}"
         * (cfg.moe_router_score_function != "sigmoid"), f"{NAME}'s scores are sigmoids"),
        ("--moe-router-num-groups {} --moe-router-group-topk {}".format(*groups)
         * (groups[1] is not None and k != 2 * groups[1]),
         f"{NAME} ranks groups by their top 2 scores, megart by their top k / group_topk"),
        (("no --moe-shared-expert-intermediate-size" if shared is None else
          f"--moe-shared-expert-intermediate-size {shared}") * (shared is None or
          shared % cfg.moe_ffn_size > 0), f"{NAME}'s shared expert is n_shared_experts "
         "x moe_intermediate_size wide"),
        ("--moe-shared-expert-gate" * cfg.moe_shared_expert_gate,
         f"{NAME}'s shared expert has no gate"),
        ("" if capacity is None else f"--moe-expert-capacity-factor {capacity:g}",
         f"{NAME}'s experts take every token routed to them"),
    ]  # fmt: skip
    hf_experts.refuse_routing(unlike, NAME)


def names(cfg: GPTConfig, i: int) -> list[tuple[str, str]]:
    """Layer i's (megart, DeepSeek-V3) tensor names, with ".weight" (the expert bias's
    buffer without)."""
    m, g = f"chunk.blocks.{i}.", f"model.layers.{i}."
    queries = QUERIES if cfg.q_lora_rank is None else QUERIES_LORA
    pairs = [(f"{m}attn.{a}.weight", f"{g}self_attn.{b}.weight") for a, b in queries + ATTENTION]
    if not cfg.is_moe_layer(i):
        mlp = [(f"{m}mlp.{a}", f"{g}mlp.{b}") for a, b in hf_experts.LLAMA_MLP_NAMES]
    else:
        routed = hf_experts.expert_names(cfg, "mlp", hf_experts.LLAMA_MLP_NAMES)(i)
        mlp = routed + [(f"{m}mlp.{a}", f"{g}mlp.{b}") for a, b in SHARED]
    pairs += [(a + ".weight", b + ".weight") for a, b in mlp]
    if cfg.is_moe_layer(i):
        pairs.append((m + "mlp.router.expert_bias", g + "mlp.gate.e_score_correction_bias"))
    return hf_llama._norm_names(i) + pairs


def _all_names(cfg: GPTConfig) -> list[tuple[str, str]]:
    pairs = [("chunk.wte.weight", "model.embed_tokens.weight")]
    for i in range(cfg.num_layers):
        pairs += names(cfg, i)
    pairs.append(hf_llama.FINAL_NORM)
    if cfg.untie_embeddings_and_output_weights:
        pairs.append(("chunk.output_layer.weight", "lm_head.weight"))
    return pairs + mtp.depth_names(cfg, names)


def _reordered(cfg: GPTConfig, ours: str, w: torch.Tensor, to_megart: bool) -> torch.Tensor:
    """A norm's weight as written: DeepSeek's RMSNorm holds the scale, one more than a
    --apply-layernorm-1p model's zero-centred weight; any other tensor as it is. Read, as
    Llama's, the scale is taken as it is: a Hugging Face config never says 1p, and import-hf
    --apply-layernorm-1p centres the norms itself (training.import_hf.NORM_WEIGHTS; centring
    here as well took 2 off)."""
    if to_megart or not cfg.apply_layernorm_1p:
        return w
    return (
        w + 1 if ours.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "norm.weight")) else w
    )


def to_megart(
    cfg: GPTConfig, take: Callable[[str], torch.Tensor], wanted: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(megart name, whole tensor) one at a time from ``take(DeepSeek-V3 name)``; only the
    names in ``wanted`` (default all). The expert biases come as
    ``chunk.blocks.i.mlp.router.expert_bias`` (buffers, not parameters); the depths' embedding
    and head copies are checked against the main tensors when their depths are wanted."""
    depths = wanted is None or "chunk.mtp.layers.0.eh_proj.weight" in wanted  # not a bias's
    if cfg.mtp_num_layers and depths:
        mtp.check_shared(cfg, take)
    for ours, theirs in _all_names(cfg):
        if wanted is None or ours in wanted:
            yield ours, _reordered(cfg, ours, take(theirs), True)


def hf_tensors(
    cfg: GPTConfig, full: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek-V3's tensors in its order from ``full(megart name)`` (vocabulary padding cut);
    a model without --moe-router-enable-expert-bias writes zero biases (the same routing)."""
    for ours, theirs in _all_names(cfg):
        if ours.endswith("expert_bias") and not cfg.moe_router_enable_expert_bias:
            yield theirs, torch.zeros(cfg.num_experts or 0)
            continue
        w = _reordered(cfg, ours, full(ours), False)
        yield theirs, w[: cfg.vocab_size] if ours in hf_vocab_rows() else w
    for ours, copy in mtp.shared_copies(cfg):  # each depth's copies of the shared tensors
        yield copy, full(ours)[: cfg.vocab_size]


def hf_vocab_rows() -> tuple[str, str]:
    """megart's parameters whose rows are the (padded) vocabulary, cut to it when written."""
    return ("chunk.wte.weight", "chunk.output_layer.weight")


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """DeepSeek-V3's config.json for ``cfg`` (rope_interleave true: megart's adjacent pairs)."""
    out = hf_llama.hf_config(cfg)
    for name in ("head_dim", "mlp_bias", "rope_scaling", "rope_theta"):
        del out[name]
    scaling: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_type == "yarn":
        scaling = hf_yarn(cfg)
        if cfg.yarn_mscale_all_dim:  # the scores' mscale, read by DeepSeek's attention
            scaling["mscale_all_dim"] = cfg.yarn_mscale_all_dim
    experts = cfg.num_experts is not None
    first = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), cfg.num_layers)
    groups = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    return {
        **out,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": MODEL_TYPE,
        "num_key_value_heads": cfg.num_attention_heads,
        "rope_parameters": {**scaling, "rope_theta": cfg.rotary_base},
        "rope_interleave": True,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_head_dim,
        "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "first_k_dense_replace": first,
        "n_routed_experts": cfg.num_experts if experts else 1,
        "num_experts_per_tok": cfg.moe_router_topk if experts else 1,
        "moe_intermediate_size": cfg.moe_ffn_size,
        "n_shared_experts": (cfg.moe_shared_expert_intermediate_size or 0) // cfg.moe_ffn_size,
        "n_group": groups[0] or 1,
        "topk_group": groups[1] or 1,
        "norm_topk_prob": cfg.moe_router_topk > 1,
        "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
        "num_nextn_predict_layers": cfg.mtp_num_layers or 0,
        "output_router_logits": False,
    }
