"""Hugging Face Qwen3-MoE (``Qwen3MoeForCausalLM``) as one of megart.models.hf's formats.

A Qwen3-MoE is a Qwen3 (megart.models.hf_qwen3: Llama's names and layouts, --qk-layernorm, no
biases, head_dim as --kv-channels) whose MLPs are mixtures of experts, megart's --num-experts
(num_experts) with --moe-router-topk (num_experts_per_tok) SwiGLU experts of
--moe-ffn-hidden-size (moe_intermediate_size), on some layers or all. Its files (the per-expert
layout transformers 5 still writes and reads) name layer i's ``mlp.gate`` (megart's
``mlp.router``, [E, h]) and expert e's ``mlp.experts.e.gate_proj``, ``up_proj`` and
``down_proj`` (megart's ``gate``, ``fc`` and ``proj``); its dense layers are Llama's, of
intermediate_size (--ffn-hidden-size).

Which layers have experts: transformers' layer i does where i is not in mlp_only_layers and
(i + 1) % decoder_sparse_step == 0, counting from 1 where megart's --moe-layer-freq N counts
from 0 (i % N == 0); megart reads the pattern as the per-layer list form of --moe-layer-freq
(the int 1 where every layer has experts) and writes decoder_sparse_step 1 with the dense
layers in mlp_only_layers, which spells any pattern.

Routing: transformers takes the softmax over all experts in fp32 and keeps the top k; with
norm_topk_prob true it divides them by their sum, which is the softmax of the top k logits,
megart's default (hf_mixtral says why); with norm_topk_prob false (the config's default, and
Qwen3-30B-A3B's is true) it keeps them as they are, megart's --moe-router-pre-softmax. Sigmoid
scores or a top-k scaling factor have no Qwen3-MoE spelling and are refused naming the flag;
so is num_experts_per_tok 1 with norm_topk_prob true (weight 1, which megart refuses to
train). The router's aux loss (router_aux_loss_coef, output_router_logits) is training's, not
the model's, and is not carried (megart.training.import_hf.moe_flags says why); shared experts
(Qwen2-MoE's, which Qwen3MoeForCausalLM has none of) are refused where a config names them.

The sliding window: transformers 5's Qwen3-MoE windows every layer with use_sliding_window
(Mistral's mask, megart's --window-size W-1,0), and earlier versions only the layers from
max_window_layers on, so megart reads a window only where max_window_layers is 0 or absent
(both agree) and writes max_window_layers 0; a window on some layers only is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megart.errors import ConfigError
from megart.models import hf_experts, hf_llama, hf_mistral, hf_qwen3
from megart.models.config import GPTConfig

NAME = "Qwen3-MoE"
MODEL_TYPE = "qwen3_moe"
FILE_PREFIX = ""

# megart's expert MLP -> Qwen3-MoE's: Llama's MLP names, per expert.
EXPERT_NAMES = hf_experts.LLAMA_MLP_NAMES
# transformers' Qwen3MoeConfig defaults, where a config.json leaves a field out.
DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                norm_topk_prob=False, decoder_sparse_step=1)  # fmt: skip


def moe_names(cfg: GPTConfig) -> hf_llama.MoeNames:
    """Layer i's (megart, Qwen3-MoE) router and expert names, without ".weight"."""
    return hf_experts.expert_names(cfg, "mlp", EXPERT_NAMES)


def check(cfg: GPTConfig) -> None:
    """Refuses a model a Qwen3-MoE checkpoint cannot represent, naming each flag: Qwen3's
    refusals, a window on some layers only, and routing other than a softmax's."""
    hf_qwen3.check_qwen3_style(cfg, NAME)
    hf_mistral.refuse_some_windows(cfg, NAME)
    hf_experts.require_experts(cfg, NAME, "a Qwen3")
    unlike = [*softmax_routing(cfg, NAME), hf_experts.shared_experts(cfg, NAME)]
    hf_experts.refuse_routing(unlike, NAME)


def softmax_routing(cfg: GPTConfig, fmt: str = NAME) -> list[tuple[str, str]]:
    """hf_experts.softmax_routing for Qwen3-MoE's (or Qwen2-MoE's: format ``fmt``) router,
    whose weights are the probabilities or, with norm_topk_prob, those divided by their sum."""
    weights = f"{fmt}'s routing weights are the probabilities, or those divided by their sum"
    return hf_experts.softmax_routing(cfg, fmt, weights)


def sparse_layers(
    hf: dict[str, Any], fmt: str = NAME, defaults: dict[str, Any] = DEFAULTS
) -> list[bool]:
    """Which layers transformers' Qwen3MoeForCausalLM (or Qwen2-MoE's, by the same rule, with
    its ``defaults``: format ``fmt``) gives experts."""
    step, dense = _field(hf, "decoder_sparse_step", defaults), hf.get("mlp_only_layers") or []
    if type(step) is not int or step < 1:
        raise ConfigError(
            f"this {fmt} has decoder_sparse_step {step!r}: give 1 or more (layer i has experts "
            "where (i + 1) % decoder_sparse_step == 0)"
        )
    experts = _field(hf, "num_experts", defaults) > 0
    return [experts and i not in dense and (i + 1) % step == 0
            for i in range(hf["num_hidden_layers"])]  # fmt: skip


def _field(hf: dict[str, Any], name: str, defaults: dict[str, Any] = DEFAULTS) -> Any:
    """A Qwen3-MoE (or Qwen2-MoE: its ``defaults``) field by transformers' name or default;
    num_experts is saved by transformers 5 as num_local_experts (its attribute_map), by the
    hub's configs as itself."""
    if name == "num_experts" and name not in hf:
        return hf.get("num_local_experts", defaults[name])
    return hf.get(name, defaults[name])


def window(hf: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's window_size for a window in every layer, where the versions of transformers
    agree that it is one (the module's docstring)."""
    if not hf.get("use_sliding_window"):
        return {}  # transformers' Qwen3MoeConfig drops sliding_window then
    layers = hf_mistral.window(hf, NAME)
    first = hf.get("max_window_layers") or 0
    if layers and first:
        raise ConfigError(
            f"this {NAME} has use_sliding_window true with max_window_layers {first}: "
            "transformers 5 windows every layer, earlier versions only the layers from "
            f"{first} on, and megart does not guess which was meant; set max_window_layers 0 "
            "(every layer) or use_sliding_window false"
        )
    return layers


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """Qwen3's reading (Llama's sizes, rope and refusals, query/key norms, no biases), with
    the experts on the layers that have them and the routing norm_topk_prob says."""
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError(
            f"this {NAME} has shared_expert_intermediate_size "
            f"{hf['shared_expert_intermediate_size']} (shared experts beside the routed ones), "
            "which megart's MoE cannot represent (and Qwen3MoeForCausalLM does not build)"
        )
    cfg = dataclasses.replace(hf_qwen3.qwen3_style(hf, NAME), **window(hf))
    return with_experts(cfg, hf)


def with_experts(
    cfg: GPTConfig, hf: dict[str, Any], fmt: str = NAME, defaults: dict[str, Any] = DEFAULTS
) -> GPTConfig:
    """``cfg`` with the experts of a Qwen3-MoE's (or Qwen2-MoE's: format ``fmt``, its
    ``defaults``) config ``hf`` on the layers that have them, routed as norm_topk_prob says;
    ``cfg`` itself where no layer has experts."""
    sparse = sparse_layers(hf, fmt, defaults)
    if not any(sparse):  # a dense model in all but name
        return cfg
    k = _field(hf, "num_experts_per_tok", defaults)
    normalised = bool(_field(hf, "norm_topk_prob", defaults))
    if normalised:
        hf_experts.refuse_weight_one(k, fmt, " with norm_topk_prob true")
    width = _field(hf, "moe_intermediate_size", defaults)
    return dataclasses.replace(
        cfg,
        num_experts=_field(hf, "num_experts", defaults),
        moe_router_topk=k,
        moe_router_pre_softmax=not normalised,
        moe_ffn_hidden_size=None if width == cfg.ffn_hidden_size else width,
        moe_layer_freq=1 if all(sparse) else tuple(int(s) for s in sparse),
    )


# Qwen3's conversions with Qwen3-MoE's routers and experts (all renamed, none reshaped).
to_megart, hf_tensors = hf_experts.conversions(hf_qwen3, moe_names)


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """Qwen3-MoE's config.json: Llama's with the experts, the dense layers in mlp_only_layers
    and the window (check() has refused one on some layers only)."""
    out = hf_llama.hf_config(cfg)
    del out["mlp_bias"]
    window: dict[str, Any] = {"use_sliding_window": False, "sliding_window": None}
    if cfg.layer_window(0) is not None:  # then every layer's
        assert cfg.window_size is not None
        window = {"use_sliding_window": True, "sliding_window": cfg.window_size[0] + 1}
    return {
        **out,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": MODEL_TYPE,
        **expert_fields(cfg),
        **window,
        "max_window_layers": 0,  # earlier transformers window the layers from it on
    }


def expert_fields(cfg: GPTConfig) -> dict[str, Any]:
    """The config.json fields of ``cfg``'s MLPs and experts, Qwen3-MoE's and Qwen2-MoE's."""
    return {
        "intermediate_size": cfg.ffn_size,
        "moe_intermediate_size": cfg.moe_ffn_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "norm_topk_prob": not cfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)],
        # Training settings of transformers' own, off: megart's --moe-aux-loss-coeff is
        # another loss (megart.training.import_hf.moe_flags).
        "output_router_logits": False,
    }
