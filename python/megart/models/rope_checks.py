"""The checks of GPTConfig's rope fields (Megatron's --rotary-percent, --use-rope-scaling,
--rope-scaling-factor, --rotary-seq-len-interpolation-factor, and YaRN's,
--position-embedding-type yarn), kept apart from the config itself, which calls them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megart.errors import ConfigError
from megart.models.yarn import ROPE_TYPES, yarn_mscale

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
    check_yarn(cfg)


def check_yarn(cfg: GPTConfig) -> None:
    """Refuses YaRN (rope_type "yarn", Megatron's --position-embedding-type yarn) where it
    cannot apply, and settings it cannot compute. Megatron-Core's YarnRotaryEmbedding
    silently ignores --use-rope-scaling, --rotary-seq-len-interpolation-factor and
    --rotary-percent (it turns the whole head, where Hugging Face's yarn narrows its
    frequencies to the part), and asserts against --rotary-interleaved: megart refuses each
    beside it rather than pick a meaning."""
    if cfg.rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_type={cfg.rope_type!r}; use one of {', '.join(ROPE_TYPES)}")
    if cfg.rope_type != "yarn":
        return
    if cfg.position_embedding != "rotary":
        raise ConfigError(
            "rope_type='yarn' scales rope's frequencies: it needs position_embedding='rotary' "
            "(megart train's --position-embedding-type yarn sets both)"
        )
    beside = [
        flag
        for flag, on in (
            ("--use-rope-scaling", cfg.rope_scaling),
            (
                f"--rotary-seq-len-interpolation-factor {cfg.rotary_seq_len_interpolation_factor}",
                cfg.rotary_seq_len_interpolation_factor is not None,
            ),
            (f"--rotary-percent {cfg.rotary_percent:g}", cfg.rotary_percent != 1),
            ("--rotary-interleaved", cfg.rotary_interleaved),
        )
        if on
    ]
    if beside:
        raise ConfigError(
            f"--position-embedding-type yarn with {' and '.join(beside)}: Megatron-Core's YaRN "
            "ignores --use-rope-scaling, --rotary-seq-len-interpolation-factor and "
            "--rotary-percent (it turns whole heads with its own frequencies) and refuses "
            "--rotary-interleaved; leave " + ("them" if len(beside) > 1 else "it") + " out"
        )
    factor, original = cfg.yarn_rotary_scaling_factor, cfg.yarn_original_max_position_embeddings
    if not 1 <= factor < math.inf:  # also refuses NaN
        raise ConfigError(
            f"--rotary-scaling-factor {factor:g} (yarn_rotary_scaling_factor): YaRN extends the "
            "context this many times, dividing the slow frequencies by it, so it must be a "
            "finite number of at least 1 (1 leaves rope unscaled)"
        )
    if original < 1:
        raise ConfigError(
            f"--yarn-original-max-position-embeddings {original}: the context the model was "
            "trained with before the extension must be at least 1"
        )
    fast, slow = cfg.yarn_beta_fast, cfg.yarn_beta_slow
    if not 0 < slow < fast < math.inf:
        raise ConfigError(
            f"--yarn-beta-fast {fast:g} and --yarn-beta-slow {slow:g}: the channel pairs turning "
            "more than beta_fast times over the original context keep their frequency, those "
            "turning fewer than beta_slow times are interpolated, so 0 < beta_slow < "
            "beta_fast (YaRN's 1 and 32 by default)"
        )
    top = yarn_mscale(factor, cfg.yarn_mscale)
    bottom = yarn_mscale(factor, cfg.yarn_mscale_all_dim)
    if not (bottom != 0 and 0 < top / bottom < math.inf):
        raise ConfigError(
            f"--mscale {cfg.yarn_mscale:g} and --mscale-all-dim {cfg.yarn_mscale_all_dim:g} "
            f"with --rotary-scaling-factor {factor:g}: YaRN multiplies cos and sin by "
            "(0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1), which must be a "
            "positive finite number"
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
