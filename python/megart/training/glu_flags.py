"""Megatron-LM's --quick-geglu, --glu-linear-offset and --activation-func-clamp-value (gpt-oss's
MLP, models.mlp.MLP.act) between megart train's flags, Megatron-LM's args and GPTConfig."""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.models.config import GPTConfig

_FUSED = (
    "Megatron-LM's default fuses the bias add into the activation, where its dense MLP refuses "
    "quick GeGLU and its experts clamp before adding the bias; megart computes the unfused "
    "path (bias, then clamp: gpt-oss's)"
)


def glu_args(cfg: GPTConfig) -> dict[str, Any]:
    """The three as Megatron-LM's args hold them."""
    return dict(
        quick_geglu=cfg.activation == "quick_geglu",
        glu_linear_offset=cfg.glu_linear_offset,
        activation_func_clamp_value=cfg.activation_func_clamp_value,
    )


def glu_fields(a: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's offset and clamp from Megatron-LM's args or megart train's flags (the same
    names; absent from older args: none). Refuses a clamp with biases under the fused bias
    activation (Megatron-LM's bias_gelu_fusion), whose experts clamp before the bias."""
    clamp = a.get("activation_func_clamp_value")
    bias = a.get("add_bias_linear", not a.get("disable_bias_linear", False))
    if a.get("quick_geglu") and clamp is not None and bias and a.get("bias_gelu_fusion"):
        raise ConfigError(
            f"--quick-geglu with biases and a clamp: {_FUSED}; give --no-bias-gelu-fusion"
        )
    return dict(
        glu_linear_offset=float(a.get("glu_linear_offset") or 0.0),
        activation_func_clamp_value=None if clamp is None else float(clamp),
    )


def check_glu_flags(config: Any) -> None:
    """Refuses --quick-geglu beside another activation, and with biases unless the fusion is
    off (--no-bias-gelu-fusion), naming the flags."""
    if not config.quick_geglu:
        return
    others = [f"--{n.replace('_', '-')}" for n in ("swiglu", "squared_relu") if getattr(config, n)]
    if others:
        raise ConfigError(
            f"--quick-geglu and {' and '.join(others)} are two MLP activations: give one "
            "(Megatron-LM asserts it too)"
        )
    if not config.disable_bias_linear and config.bias_gelu_fusion is not False:
        raise ConfigError(
            f"--quick-geglu with biases: {_FUSED}; give --no-bias-gelu-fusion (as gpt-oss's "
            "recipe does) or --disable-bias-linear"
        )
