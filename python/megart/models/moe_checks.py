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
# microbatch, DeepSeek's over each sequence, the global batch's (its counts over every
# data-parallel rank and the iteration's microbatches), or none. Its sinkhorn is refused by
# name (check_moe).
BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")

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
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs",
    "moe_pad_expert_input_to_capacity": False,
    "moe_input_jitter_eps": None,
    "moe_router_force_load_balancing": False,
}
DROP_POLICIES = ("probs", "position")


def flag(field: str) -> str:
    """A GPTConfig MoE field's Megatron flag (--num-experts, --moe-router-topk, ...)."""
    return "--" + field.replace("_", "-")


def capacity_factor(factor: float | None) -> float | None:
    """--moe-expert-capacity-factor as GPTConfig takes it: a negative one is none (no
    dropping), as Megatron-Core's TransformerConfig reads it."""
    return None if factor is None or factor < 0 else float(factor)


def is_moe_layer(cfg: GPTConfig, layer: int) -> bool:
    """Whether layer ``layer`` (0-based) is an MoE layer: every one of --moe-layer-freq N
    starting with the first (Megatron-Core's i % N == 0), or the pattern's 1s. Past the
    decoder's layers, a multi-token prediction depth's layer (models.mtp numbers them on) is of
    the last decoder layer's kind, as Megatron-Core gives the depths that layer's spec whatever
    the pattern would say of their numbers."""
    if cfg.num_experts is None:
        return False
    layer = min(layer, cfg.num_layers - 1)
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
    eps = cfg.moe_input_jitter_eps
    if eps is not None and not 0 <= eps < 1:
        # Megatron-Core takes any; a factor of 1 - eps <= 0 would flip or zero the input.
        raise ConfigError(f"--moe-input-jitter-eps {eps}: give a number in [0, 1)")
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


def check_expert_parallel_layer(cfg: GPTConfig, ep: int) -> None:
    """Refuses an MoE layer spread over ``ep`` > 1 expert-parallel ranks that it cannot be:
    experts not divisible by ``ep``."""
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
            "(the Switch Transformer's loss over each microbatch, Megatron's default), "
            "seq_aux_loss (over each sequence), global_aux_loss (over the global batch) or none; "
            "Megatron's sinkhorn is not built"
        )
    coeff, z = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
    if not coeff >= 0 or (z is not None and not z >= 0):  # also refuses NaN
        raise ConfigError(
            f"--moe-aux-loss-coeff {coeff:g}, --moe-z-loss-coeff {z}: the losses' "
            "coefficients are 0 or more"
        )
    if coeff > 0 and balancing == "none":
        raise ConfigError(
            f"--moe-aux-loss-coeff {coeff:g} weighs the load-balancing loss, which "
            f"--moe-router-load-balancing-type {balancing} does not compute: give aux_loss, "
            "seq_aux_loss or global_aux_loss, or leave the coefficient out"
        )
    if balancing == "global_aux_loss" and coeff > 0 and cfg.recompute_granularity == "full":
        # Its running counts grow in each forward, which recomputation would run twice.
        raise ConfigError(
            "--moe-router-load-balancing-type global_aux_loss with --recompute-granularity "
            "full: not built (the loss's counts accumulate over the iteration's forwards); "
            "leave one out"
        )
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function != "sigmoid":
        raise ConfigError(  # Megatron-Core's TransformerConfig refuses it too
            "--moe-router-enable-expert-bias: the expert bias is added to sigmoid scores "
            "only; add --moe-router-score-function sigmoid (as Megatron-LM asks)"
        )
    _check_groups(cfg)
    _check_capacity(cfg)
    factor = cfg.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0:
        raise ConfigError(
            f"--moe-router-topk-scaling-factor {factor:g}: the routing weights are multiplied "
            "by it; give a positive number or leave it out"
        )


def _check_groups(cfg: GPTConfig) -> None:
    """Group-limited routing: Megatron-Core's checks (both flags; the groups divide the
    experts; no more chosen groups than groups), and that the chosen groups hold the top k
    (each its top k / group_topk, at least one), which Megatron-Core leaves to fail in
    torch.topk."""
    groups, chosen = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if groups is None and chosen is None:
        return
    e, k = cfg.num_experts, cfg.moe_router_topk
    both = "--moe-router-num-groups G and --moe-router-group-topk g"
    if groups is None or chosen is None:
        raise ConfigError(f"group-limited routing takes both {both}: give both or neither")
    if groups < 1 or e % groups:
        raise ConfigError(
            f"--moe-router-num-groups {groups}: the groups split --num-experts {e} evenly"
        )
    size = e // groups
    if not 1 <= chosen <= groups or not chosen <= k <= chosen * size:
        raise ConfigError(
            f"--moe-router-group-topk {chosen}: each token takes its --moe-router-topk {k} "
            f"experts from {chosen} of the {groups} groups of {size}, scored by their top "
            f"k/g; give 1 <= g <= G with g <= k <= g x {size}"
        )


def _check_capacity(cfg: GPTConfig) -> None:
    """Token dropping: a positive capacity factor (Megatron-LM's flags read a negative one as
    none: model_flags), one of Megatron's two policies, padding and a policy other than the
    default only with a capacity (Megatron-Core refuses padding without; the policy alone it
    would ignore)."""
    factor, policy = cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy
    if factor is not None and not factor > 0:
        raise ConfigError(
            f"--moe-expert-capacity-factor {factor:g}: each expert takes ceil(tokens x topk / "
            "experts x this) tokens; give a positive factor, or leave it out (no dropping)"
        )
    if policy not in DROP_POLICIES:
        raise ConfigError(
            f"--moe-token-drop-policy {policy}: use probs (drop the lowest routing weights) or "
            "position (drop the latest tokens)"
        )
    if factor is None and (cfg.moe_pad_expert_input_to_capacity or policy != "probs"):
        given = "--moe-pad-expert-input-to-capacity" * cfg.moe_pad_expert_input_to_capacity
        given = given or f"--moe-token-drop-policy {policy}"
        raise ConfigError(
            f"{given}: the experts' capacity needs --moe-expert-capacity-factor C (as "
            "Megatron-LM asks); give it or leave this out"
        )
