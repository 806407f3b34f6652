"""--moe-use-upcycling's refusals and rule (megart.training.upcycling does the upcycling):
kept apart so that the config's checks import no checkpoint code."""

from __future__ import annotations

import dataclasses
from typing import Any

from megart.errors import ConfigError
from megart.models import GPTConfig


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one MoE layer is made from the dense MLP (Megatron-Core's _get_config)."""

    num_experts: int
    granularity: int
    scale: float

    @classmethod
    def of(cls, cfg: GPTConfig, dense_ffn: int) -> Rule:
        """The rule for MoE model ``cfg`` from a dense MLP ``dense_ffn`` wide."""
        e, width = cfg.num_experts, cfg.moe_ffn_size
        if dense_ffn % width or e % (dense_ffn // width):
            raise ConfigError(
                f"--moe-use-upcycling: the dense MLP's width {dense_ffn} (--ffn-hidden-size x "
                f"--moe-upcycling-granularity) must be a multiple of the experts' {width} "
                f"(--moe-ffn-hidden-size), and the granularity {dense_ffn / width:g} must "
                f"divide --num-experts {e}, as Megatron-LM requires"
            )
        g = dense_ffn // width
        a = e * g / cfg.moe_router_topk if cfg.moe_router_pre_softmax else g
        cubic = cfg.activation in ("swiglu", "squared_relu")
        return cls(e, g, a ** (1 / 3) if cubic else a ** (1 / 2))


def check_upcycling(config: Any) -> None:
    """Refuses what --moe-use-upcycling cannot do, naming the flags; turns on --no-load-optim and
    --no-load-rng as Megatron-LM's validate_args does (its args record them so)."""
    if not config.moe_use_upcycling:  # the granularity alone changes nothing, as in Megatron
        return
    flag = "--moe-use-upcycling"
    if not config.num_experts:
        raise ConfigError(f"{flag} needs --num-experts: the MoE model the dense one becomes")
    if config.moe_upcycling_granularity < 1:
        raise ConfigError(
            f"--moe-upcycling-granularity {config.moe_upcycling_granularity}: give 1 or more"
        )
    if not config.save:
        raise ConfigError(f"{flag} needs --save (Megatron-LM's rule): the upcycled model's")
    if not (config.load or config.pretrained_checkpoint):
        raise ConfigError(f"{flag} needs --load (or --pretrained-checkpoint): the dense model's")
    cfg = config.gpt_config()
    if cfg.activation == "quick_geglu":  # Megatron-Core's upcycling refuses quick_gelu
        raise ConfigError(f"{flag} with --quick-geglu: Megatron-LM upcycles GeLU, SwiGLU and "
                          "squared ReLU MLPs only; leave one of the two out")  # fmt: skip
    if not all(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers)):
        raise ConfigError(
            f"{flag} with --moe-layer-freq {config.moe_layer_freq}: Megatron-LM's upcycling "
            "gives every dense layer experts (its strict load fails on a dense layer beside MoE "
            "ones); leave --moe-layer-freq out"
        )
    Rule.of(cfg, cfg.ffn_size * config.moe_upcycling_granularity)
    config.no_load_optim = config.no_load_rng = True
