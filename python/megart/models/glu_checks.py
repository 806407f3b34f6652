"""Checks of the gated MLP activations' settings (Megatron's --glu-linear-offset and
--activation-func-clamp-value, gpt-oss's MLP), kept out of models.config."""

from __future__ import annotations

import math

from megart.errors import ConfigError


def check_glu(activation: str, offset: float, clamp: float | None) -> None:
    """Refuses the offset and the clamp outside quick_geglu, and a clamp that is not a
    positive number. Megatron-Core reads both in any gated unit's unfused path, but its fused
    SwiGLU (Megatron-LM's default) ignores the clamp and refuses the offset, so megart keeps
    them to the activation gpt-oss uses them with."""
    flags = (("--glu-linear-offset", offset != 0.0), ("--activation-func-clamp-value", clamp))
    given = [n for n, on in flags if on is not None and on is not False]
    if given and activation != "quick_geglu":
        raise ConfigError(
            f"{' and '.join(given)} set the gated MLP of --quick-geglu (gpt-oss's); give "
            f"--quick-geglu or leave {'them' if len(given) > 1 else 'it'} out (the MLP is "
            f"{activation})"
        )
    if not math.isfinite(offset):
        raise ConfigError(f"--glu-linear-offset {offset}: give a finite number")
    if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
        raise ConfigError(
            f"--activation-func-clamp-value {clamp}: the clamp keeps the gate at most and the "
            "linear half within plus or minus it; give a positive number (gpt-oss's is 7.0)"
        )
