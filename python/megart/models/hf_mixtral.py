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
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models import hf_llama, hf_mistral
from megart.models.config import GPTConfig

NAME = "Mixtral"
MODEL_TYPE = "mixtral"
FILE_PREFIX = ""

# megart's expert MLP -> Mixtral's: w1 gates, w3 is the up projection it multiplies, w2 down.
EXPERT_NAMES = (("gate", "w1"), ("fc", "w3"), ("proj", "w2"))


def moe_names(cfg: GPTConfig) -> hf_llama.MoeNames:
    """Layer i's (megart, Mixtral) router and expert names, without ".weight"."""
    return hf_llama.expert_names(cfg, "block_sparse_moe", EXPERT_NAMES)


def check(cfg: GPTConfig) -> None:
    """Refuses a model a Mixtral checkpoint cannot represent, naming each flag: Mistral's
    refusals (its window in every layer or none), and experts other than Mixtral's."""
    hf_mistral.check_unbiased_llama(cfg, NAME)
    hf_mistral.refuse_some_windows(cfg, NAME)
    if cfg.num_experts is None:
        raise ConfigError(
            f"megart writes a {NAME} checkpoint only for a model with --num-experts (its "
            "mixture of experts); this one has none, and is written as a Llama or a Mistral"
        )
    unlike = [
        (_layer_freq(cfg), "Mixtral has no dense MLP layers: give every layer experts"),
        (
            "--moe-router-pre-softmax" * cfg.moe_router_pre_softmax,
            "Mixtral divides the top k probabilities by their sum",
        ),
        *softmax_routing(cfg, NAME, "Mixtral's routing weights sum to 1"),
        shared_experts(cfg, NAME),
    ]
    refuse_routing(unlike, NAME)


def softmax_routing(cfg: GPTConfig, fmt: str, weights: str) -> list[tuple[str, str]]:
    """(flag or "", why) for the router settings a Hugging Face softmax router (format
    ``fmt``'s; ``weights`` says what its weights are) cannot spell: sigmoid scores, a top-k
    scaling factor, an expert bias, group-limited routing, token dropping."""
    groups = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    factor = cfg.moe_expert_capacity_factor
    return [
        (
            "" if factor is None else f"--moe-expert-capacity-factor {factor:g}",
            f"{fmt}'s experts take every token routed to them (no capacity, nothing dropped)",
        ),
        (
            "--moe-router-enable-expert-bias" * cfg.moe_router_enable_expert_bias,
            f"{fmt}'s router has no expert bias",
        ),
        (
            "--moe-router-num-groups {} --moe-router-group-topk {}".format(*groups)
            * (groups != (None, None)),
            f"{fmt} routes each token to the top k of all experts",
        ),
        (
            f"--moe-router-score-function {cfg.moe_router_score_function}"
            * (cfg.moe_router_score_function != "softmax"),
            f"{fmt}'s scores are a softmax",
        ),
        (
            f"--moe-router-topk-scaling-factor {cfg.moe_router_topk_scaling_factor}"
            * (cfg.moe_router_topk_scaling_factor not in (None, 1.0)),
            weights,
        ),
    ]


def shared_experts(cfg: GPTConfig, fmt: str) -> tuple[str, str]:
    """(flag or "", why) for shared experts, which format ``fmt`` has none of."""
    size = cfg.moe_shared_expert_intermediate_size
    flag = "" if size is None else f"--moe-shared-expert-intermediate-size {size}"
    return flag, f"{fmt} has no shared experts"


def refuse_routing(unlike: list[tuple[str, str]], fmt: str) -> None:
    """Refuses the model for format ``fmt`` naming each (flag, why) of ``unlike`` whose flag
    was given (not "")."""
    said = "; ".join(f"{flag} ({why})" for flag, why in unlike if flag)
    if said:
        raise ConfigError(f"a {fmt} checkpoint cannot represent {said}")


def _layer_freq(cfg: GPTConfig) -> str:
    """--moe-layer-freq as given, where some layer is dense ("" where every layer has
    experts)."""
    if all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        return ""
    freq = cfg.moe_layer_freq
    return "--moe-layer-freq " + (str(freq) if isinstance(freq, int) else str(list(freq)))


def refuse_weight_one(k: int, fmt: str, why: str = "") -> None:
    """Refuses format ``fmt``'s num_experts_per_tok ``k`` of 1 where the router divides the
    top k by their sum (``why``: the config field that says so, if one does)."""
    if k == 1:
        raise ConfigError(
            f"this {fmt} has num_experts_per_tok 1{why}, which megart's GPT cannot represent: "
            f"{fmt} gives the one expert weight 1, the routing megart (as Megatron-LM) refuses "
            "for --moe-router-topk 1 since the router would get no gradient, and "
            "--moe-router-pre-softmax would weigh it by its probability instead"
        )


def config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    """Mistral's reading (Llama's sizes, rope and refusals, the window), with experts in every
    layer."""
    experts, k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
    refuse_weight_one(k, NAME)
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


def to_megart(
    cfg: GPTConfig, take: Callable[[str], torch.Tensor], wanted: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Llama's conversion with Mixtral's router and experts (all renamed, none reshaped)."""
    return hf_llama.to_megart(cfg, take, wanted, moe=moe_names(cfg))


def hf_tensors(
    cfg: GPTConfig, full: Callable[[str], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Llama's tensors with Mixtral's router and experts after each o_proj."""
    return hf_llama.hf_tensors(cfg, full, moe=moe_names(cfg))


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
