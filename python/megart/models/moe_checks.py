"""GPTConfig's mixture-of-experts fields (Megatron's --num-experts and --moe-* flags): which
layers are MoE layers, and the checks of the fields, kept apart from the config itself, which
calls them. The layers themselves are megart.models.moe's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.errors import ConfigError

if TYPE_CHECKING:
    from megart.models.config import GPTConfig

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPES = (None, "fp32", "fp64")
# Of Megatron's --moe-router-load-balancing-type: the Switch Transformer's loss over each
# microbatch, or none. Its seq_aux_loss, global_aux_loss, sinkhorn and quantile_balancing are
# refused by name (check_moe).
BALANCING = ("aux_loss", "none")

# The MoE fields' defaults (Megatron-Core's TransformerConfig's), by field: a model without
# experts must leave them so, as anything else would be ignored.
MOE_DEFAULTS: dict[str, object] = {
    "moe_ffn_hidden_size": None,
    "moe_layer_freq": 1,
    "moe_router_topk": 2,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_dtype": None,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
}


def flag(field: str) -> str:
    """A GPTConfig MoE field's Megatron flag (--num-experts, --moe-router-topk, ...)."""
    return "--" + field.replace("_", "-")


def is_moe_layer(cfg: GPTConfig, layer: int) -> bool:
    """Whether layer ``layer`` (0-based) is an MoE layer: every one of --moe-layer-freq N
    starting with the first (Megatron-Core's i % N == 0), or the pattern's 1s."""
    if cfg.num_experts is None:
        return False
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        return layer % freq == 0
    return bool(freq[layer])


def check_moe(cfg: GPTConfig) -> None:
    """Refuses MoE fields Megatron-LM would refuse or megart cannot honour, saying what to
    give instead."""
    if cfg.num_experts is None:
        given = [
            f"{flag(f)} ({f}={getattr(cfg, f)!r})"
            for f, default in MOE_DEFAULTS.items()
            if getattr(cfg, f) != default
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)}: mixture-of-experts settings, but the model has no "
                "experts: add --num-experts E or leave them out"
            )
        return
    e, k = cfg.num_experts, cfg.moe_router_topk
    if e < 1:
        raise ConfigError(f"--num-experts {e}: give 1 or more experts (or leave it out)")
    if not 1 <= k <= e:
        raise ConfigError(
            f"--moe-router-topk {k}: each token goes to between 1 and --num-experts {e} experts"
        )
    if k == 1 and cfg.moe_router_score_function == "softmax" and not cfg.moe_router_pre_softmax:
        # The softmax of one logit is 1: the router would never learn (Megatron refuses too).
        raise ConfigError(
            "--moe-router-topk 1 with the softmax over the chosen logit gives every token weight "
            "1 and the router no gradient: add --moe-router-pre-softmax (as Megatron-LM asks)"
        )
    if cfg.moe_ffn_hidden_size is not None and cfg.moe_ffn_hidden_size < 1:
        raise ConfigError(f"--moe-ffn-hidden-size {cfg.moe_ffn_hidden_size}: give 1 or more")
    shared = cfg.moe_shared_expert_intermediate_size
    if shared is not None and shared < 1:
        raise ConfigError(
            f"--moe-shared-expert-intermediate-size {shared}: give 1 or more (or leave it out: "
            "no shared experts)"
        )
    if cfg.moe_shared_expert_gate and shared is None:
        # Megatron-Core would build no gate and say nothing: the flag would be ignored.
        raise ConfigError(
            "--moe-shared-expert-gate gates the shared experts' output, but there are none: "
            "add --moe-shared-expert-intermediate-size S or leave the gate out"
        )
    _check_router(cfg)
    freq = cfg.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"--moe-layer-freq {freq}: give 1 or more (1: every layer is MoE)")
    if not isinstance(freq, int) and (
        len(freq) != cfg.num_layers or any(x not in (0, 1) for x in freq)
    ):
        raise ConfigError(
            f"--moe-layer-freq {list(freq)}: give one 0 (dense) or 1 (MoE) per layer, "
            f"{cfg.num_layers} in all"
        )
    if cfg.recomputes("layernorm"):
        # Its dropped norm output is made again for a column-parallel product's input; an MoE
        # layer's experts read gathered rows of it instead.
        raise ConfigError(
            "--recompute-modules layernorm with --num-experts: not built for MoE layers yet; "
            "leave layernorm out (core_attn and mlp apply)"
        )
    if cfg.bias:
        raise ConfigError(
            "megart's experts have no biases: add --disable-bias-linear to a model with "
            "--num-experts (as Mixtral's and Megatron's MoE recipes have)"
        )


def check_moe_tensor_parallel(cfg: GPTConfig, tp: int, sequence_parallel: bool) -> None:
    """Refuses experts split over ``tp`` > 1 ranks without sequence parallelism, which
    Megatron-Core's MoE layer refuses to train (its tokens are gathered from, and its outputs
    reduce-scattered to, the ranks' slices of the sequence)."""
    if cfg.num_experts is not None and tp > 1 and not sequence_parallel:
        raise ConfigError(
            f"--num-experts {cfg.num_experts} at --tensor-model-parallel-size {tp} needs "
            "--sequence-parallel (as Megatron-Core's MoE layers do): add it, or run at "
            "tensor-parallel size 1"
        )


def check_expert_parallel_layer(cfg: GPTConfig, tp: int, cp: int, ep: int) -> None:
    """Refuses an MoE layer spread over ``ep`` > 1 expert-parallel ranks that it cannot be:
    experts not divisible by ``ep``, or tensor or context parallelism as well (not built)."""
    if tp > 1 or cp > 1:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} with tensor-parallel size {tp} and context-"
            f"parallel size {cp}: megart's expert parallelism runs at both sizes 1 only"
        )
    if cfg.num_experts is None or cfg.num_experts % ep:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} must divide --num-experts {cfg.num_experts}"
        )


def moe_layout_problems(cfg: GPTConfig, tp: int) -> list[str]:
    """What keeps the experts from splitting over ``tp`` tensor-parallel ranks (for
    GPTConfig.check_layout): their width, each rank holding a 1/t of every expert (Megatron's
    expert tensor-parallel size equal to the tensor-parallel size), and the shared experts'."""
    if cfg.num_experts is None:
        return []
    widths = [(cfg.moe_ffn_size, "experts' MLP size", "--moe-ffn-hidden-size")]
    if cfg.moe_shared_expert_intermediate_size is not None:  # split as the dense MLP is
        shared = cfg.moe_shared_expert_intermediate_size
        widths.append((shared, "shared experts' MLP size", "--moe-shared-expert-intermediate-size"))
    return [
        f"the {what} {width} ({name}) does not split over tensor-parallel size {tp}"
        for width, what, name in widths
        if width % tp
    ]


def _check_router(cfg: GPTConfig) -> None:
    if cfg.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ConfigError(
            f"--moe-router-score-function {cfg.moe_router_score_function}: use one of "
            f"{', '.join(SCORE_FUNCTIONS)}"
        )
    if cfg.moe_router_dtype not in ROUTER_DTYPES:
        raise ConfigError(
            f"--moe-router-dtype {cfg.moe_router_dtype}: use fp32 or fp64 (or leave it out: "
            "the input's dtype)"
        )
    balancing = cfg.moe_router_load_balancing_type
    if balancing not in BALANCING:
        raise ConfigError(
            f"--moe-router-load-balancing-type {balancing}: megart balances with aux_loss "
            "(the Switch Transformer's loss over each microbatch, Megatron's default) or none; "
            "its seq_aux_loss, global_aux_loss, sinkhorn and quantile_balancing are not built"
        )
    coeff, z = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
    if not coeff >= 0 or (z is not None and not z >= 0):  # also refuses NaN
        raise ConfigError(
            f"--moe-aux-loss-coeff {coeff:g}, --moe-z-loss-coeff {z}: the losses' "
            "coefficients are 0 or more"
        )
    if coeff > 0 and balancing != "aux_loss":
        raise ConfigError(
            f"--moe-aux-loss-coeff {coeff:g} weighs the load-balancing loss, which "
            f"--moe-router-load-balancing-type {balancing} does not compute: give aux_loss "
            "or leave the coefficient out"
        )
    factor = cfg.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0:
        raise ConfigError(
            f"--moe-router-topk-scaling-factor {factor:g}: the routing weights are multiplied "
            "by it; give a positive number or leave it out"
        )
