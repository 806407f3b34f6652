"""Hugging Face Mixtral (``MixtralForCausalLM``) as one of megart.models.hf's formats.

A Mixtral is a Mistral (megart.models.hf_mistral: Llama's names and layouts, no biases, a
sliding window over every layer or none) whose every MLP is a mixture of experts, megart's
--num-experts (num_local_experts) with --moe-router-topk (num_experts_per_tok) SwiGLU experts
of --moe-ffn-hidden-size (intermediate_size; Mixtral has no dense MLP). Its files (transformers
4's layout, which transformers 5 still writes and reads) name layer i's
``block_sparse_moe.gate`` (megart's ``mlp.router``, [E, h]) and expert e's ``w1`` (the gate,
megart's ``mlp.experts.e.gate``), ``w3`` (the up projection, ``fc``) and ``w2`` (the down
projection, ``proj``).

Mixtral's routing takes the softmax over all experts, keeps the top k and divides them by
their sum; that is the softmax over the top k logits, megart's (and Megatron's) default
routing: the denominators cancel, since exp(l_i) / sum_all / (sum_topk exp(l_j) / sum_all) =
exp(l_i) / sum_topk exp(l_j). A model routed otherwise (--moe-router-pre-softmax without
renormalisation, sigmoid scores, a top-k scaling factor) or with dense layers has no Mixtral
spelling and is refused naming the flag; so is num_experts_per_tok 1, whose weight of 1 megart
(as Megatron) refuses to train. The training-only router settings (its aux loss, jitter) are
not the model's and are not carried either way (megart.training.import_hf says why).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megart.models import hf_experts, hf_llama, hf_mistral
from megart.models.config import GPTConfig

NAME = "Mixtral"
MODEL_TYPE = "mixtral"
FILE_PREFIX = ""

# megart's expert MLP -> Mixtral's: w1 gates, w3 is the up projection it multiplies, w2 down.
EXPERT_NAMES = (("gate", "w1"), ("fc", "w3"), ("proj", "w2"))


def moe_names(cfg: GPTConfig) -> hf_llama.MoeNames:
    """Layer i's (megart, Mixtral) router and expert names, without ".weight"."""
    return hf_experts.expert_names(cfg, "block_sparse_moe", EXPERT_NAMES)


def check(cfg: GPTConfig) -> None:
    """Refuses a model a Mixtral checkpoint cannot represent, naming each flag: Mistral's
    refusals (its window in every layer or none), and experts other than Mixtral's."""
    hf_mistral.check_unbiased_llama(cfg, NAME)
    hf_mistral.refuse_some_windows(cfg, NAME)
    hf_experts.require_experts(cfg, NAME, "a Llama or a Mistral")
    unlike = [
        (_layer_freq(cfg), "Mixtral has no dense MLP layers: give every layer experts"),
        (
            "--moe-router-pre-softmax" * cfg.moe_router_pre_softmax,
            "Mixtral divides the top k probabilities by their sum",
        ),
        *hf_experts.softmax_routing(cfg, NAME, "Mixtral's routing weights sum to 1"),
        hf_experts.shared_experts(cfg, NAME),
    ]
    hf_experts.refuse_routing(unlike, NAME)


def _layer_freq(cfg: GPTConfig) -> str:
    """--moe-layer-freq as given, where some layer is dense ("" where every layer has
    experts)."""
    if all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        return ""
    freq = cfg.moe_layer_freq
    return "--moe-layer-freq " + (str(freq) if isinstance(freq, int) else str(list(freq)))


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """Mistral's reading (Llama's sizes, rope and refusals, the window), with experts in every
    layer."""
    experts, k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
    hf_experts.refuse_weight_one(k, NAME)
    # MixtralForCausalLM's projections have no biases whatever attention_bias says.
    cfg = hf_llama.config_from_hf({**hf, "attention_bias": False, "mlp_bias": False}, NAME)
    return dataclasses.replace(
        cfg,
        **hf_mistral.window(hf, NAME),
        num_experts=experts,
        moe_router_topk=k,
        # Every layer has experts, intermediate_size wide: megart's expert width is
        # --ffn-hidden-size's (moe_ffn_hidden_size None), as Megatron-LM's Mixtral recipe.
    )


# Llama's conversions with Mixtral's router and experts (all renamed, none reshaped).
to_megart, hf_tensors = hf_experts.conversions(hf_llama, moe_names)


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """Mixtral's config.json: Llama's without the bias fields, with the experts and the window
    (null where there is none; check() has refused one on some layers only)."""
    out = hf_llama.hf_config(cfg)
    del out["attention_bias"], out["mlp_bias"]
    window = None
    if cfg.layer_window(0) is not None:  # then every layer's (check())
        assert cfg.window_size is not None
        window = cfg.window_size[0] + 1
    return {
        **out,
        "architectures": ["MixtralForCausalLM"],
        "model_type": MODEL_TYPE,
        "intermediate_size": cfg.moe_ffn_size,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_router_topk,
        "sliding_window": window,
        # Training settings of transformers' own (its aux loss is off unless
        # output_router_logits; no jitter): megart's --moe-aux-loss-coeff is another loss.
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
    }
