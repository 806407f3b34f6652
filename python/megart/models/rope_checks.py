"""The checks of GPTConfig's rope fields (Megatron's --rotary-percent, --use-rope-scaling,
--rope-scaling-factor, --rotary-seq-len-interpolation-factor), kept apart from the config
itself, which calls them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megart.errors import ConfigError

if TYPE_CHECKING:
    from megart.models.config import GPTConfig


def check_rotary_percent(cfg: GPTConfig) -> None:
    """Refuses a --rotary-percent that is not a part of each head rope can turn (an even
    number of channels), saying which percents would."""
    p, d = cfg.rotary_percent, cfg.head_dim
    if p != 1 and cfg.position_embedding != "rotary":
        raise ConfigError(
            f"--rotary-percent {p:g} (rotary_percent) is the part of each head rope turns: "
            "add --position-embedding-type rope (position_embedding='rotary') or leave it "
            "out"
        )
    if not 0 < p <= 1:  # also refuses NaN
        raise ConfigError(
            f"--rotary-percent {p:g} (rotary_percent): rope turns that part of each head, "
            "so it must be above 0 and at most 1 (1, the default, turns the whole head)"
        )
    turned = cfg.rotary_dim
    if p == 1 or (turned > 0 and turned % 2 == 0):
        return
    # The even counts on either side (2 where none turned).
    fits = [k for k in (turned - 1, max(2, turned + 1)) if 2 <= k <= d and k % 2 == 0]
    options = " or ".join(f"{percent_for(k, d)} ({k} channels)" for k in fits)
    head = (
        "--kv-channels" if cfg.kv_channels is not None else "--hidden-size / --num-attention-heads"
    )
    given = (
        f"--kv-channels {d}"
        if cfg.kv_channels is not None
        else f"--hidden-size {cfg.hidden_size} / --num-attention-heads {cfg.num_attention_heads}"
    )
    raise ConfigError(
        f"--rotary-percent {p:g} of head size {d} ({given}) turns int({d} x {p:g}) = "
        f"{turned} channel{'' if turned == 1 else 's'}, but rope turns channels in pairs, "
        "so it must be an even number of at least 2: "
        + (f"give --rotary-percent {options}, " if options else "")
        + f"or a head size ({head}) whose part is even"
    )


def check_rope_scaling(cfg: GPTConfig) -> None:
    """Refuses rope scaling (--use-rope-scaling, --rope-scaling-factor) and position
    interpolation (--rotary-seq-len-interpolation-factor) that cannot apply."""
    if cfg.rope_scaling and cfg.position_embedding != "rotary":
        raise ConfigError(
            "--use-rope-scaling (rope_scaling) scales rope's frequencies: add "
            "--position-embedding-type rope (position_embedding='rotary') or leave it out"
        )
    if not cfg.rope_scaling_factor >= 1:  # also refuses NaN
        raise ConfigError(
            f"--rope-scaling-factor {cfg.rope_scaling_factor:g} (rope_scaling_factor): "
            "the slow frequencies are divided by it, so it must be at least 1 (1 leaves "
            "them unscaled; Llama 3.1's is 8, Llama 3.2's 32)"
        )
    factor = cfg.rotary_seq_len_interpolation_factor
    if factor is not None and cfg.position_embedding != "rotary":
        raise ConfigError(
            "--rotary-seq-len-interpolation-factor (rotary_seq_len_interpolation_factor) "
            "divides rope's positions: add --position-embedding-type rope "
            "(position_embedding='rotary') or leave it out"
        )
    if factor is not None and not 0 < factor < math.inf:  # also refuses NaN
        raise ConfigError(
            f"--rotary-seq-len-interpolation-factor {factor:g} "
            "(rotary_seq_len_interpolation_factor): rope's positions are divided by it, so "
            "it must be a positive finite number (above 1 to fit a longer context into the "
            "trained angles; leave it out for none)"
        )


def percent_for(channels: int, head_dim: int) -> str:
    """The shortest --rotary-percent (at most 12 decimals) that turns ``channels`` of a head
    of ``head_dim`` (int(head_dim * percent) == channels, in Megatron-Core's float64)."""
    for decimals in range(1, 13):
        scale = 10**decimals
        percent = math.ceil(channels / head_dim * scale) / scale
        if int(head_dim * percent) == channels:
            return f"{percent:.{decimals}f}".rstrip("0").rstrip(".")
    return repr(channels / head_dim)
