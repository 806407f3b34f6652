"""What megart's mixture-of-experts Hugging Face formats (megart.models.hf_mixtral,
hf_qwen3_moe, hf_qwen2_moe) share: their experts' names (a router ``gate`` and per-expert
linear layers beside Llama's other tensors, all renamed, none reshaped), the refusals of a
softmax router's Hugging Face spelling, and the conversions that add the experts to Llama's
(or Qwen3's) tensors. What each family does differently (where the experts sit, its config's
fields, a shared expert) stays in its own module."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from types import ModuleType

import torch

from megart.errors import ConfigError
from megart.models.config import GPTConfig
from megart.models.hf_llama import MoeNames

# megart's SwiGLU MLP (gate, fc, proj) -> Llama's names, which Qwen's experts (and Qwen2-MoE's
# shared expert) use as well.
LLAMA_MLP_NAMES = (("gate", "gate_proj"), ("fc", "up_proj"), ("proj", "down_proj"))

ToMegart = Callable[
    [GPTConfig, Callable[[str], torch.Tensor], Collection[str] | None],
    Iterator[tuple[str, torch.Tensor]],
]
HfTensors = Callable[[GPTConfig, Callable[[str], torch.Tensor]], Iterator[tuple[str, torch.Tensor]]]


def expert_names(cfg: GPTConfig, block: str, experts: tuple[tuple[str, str], ...]) -> MoeNames:
    """MoeNames of a format whose layer i holds its router at ``model.layers.i.BLOCK.gate`` and
    expert e's linear layers at ``BLOCK.experts.e.NAME``, ``experts`` naming each of megart's
    (gate, fc, proj)."""

    def names(i: int) -> list[tuple[str, str]]:
        m, g = f"chunk.blocks.{i}.mlp.", f"model.layers.{i}.{block}."
        out = [(m + "router", g + "gate")]
        for e in range(cfg.num_experts or 0):
            out += [(f"{m}experts.{e}.{ours}", f"{g}experts.{e}.{w}") for ours, w in experts]
        return out

    return names


def conversions(
    base: ModuleType, moe_names: Callable[[GPTConfig], MoeNames]
) -> tuple[ToMegart, HfTensors]:
    """(to_megart, hf_tensors) of a format whose tensors are ``base``'s (megart.models.hf_llama
    or hf_qwen3) with the MoE layers' router and experts (and any shared expert) that
    ``moe_names(cfg)`` names, all renamed, none reshaped."""

    def to_megart(
        cfg: GPTConfig,
        take: Callable[[str], torch.Tensor],
        wanted: Collection[str] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return base.to_megart(cfg, take, wanted, moe=moe_names(cfg))

    def hf_tensors(
        cfg: GPTConfig, full: Callable[[str], torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return base.hf_tensors(cfg, full, moe=moe_names(cfg))

    return to_megart, hf_tensors


def require_experts(cfg: GPTConfig, fmt: str, dense: str) -> None:
    """Refuses a model without experts for format ``fmt``, which is written as ``dense`` (the
    formats named) instead."""
    if cfg.num_experts is None:
        raise ConfigError(
            f"megart writes a {fmt} checkpoint only for a model with --num-experts (its "
            f"mixture of experts); this one has none, and is written as {dense}"
        )


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
