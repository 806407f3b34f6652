"""Rotary position embeddings (rope): the angles, Llama 3.x's frequency scaling, and the
rotation of a head's channel pairs."""

from __future__ import annotations

import math

import torch

from megart.models.yarn import YarnConfig, yarn_concentration, yarn_inv_freq

# Llama 3.x's frequency scaling: the constants Meta's Llama 3.1 and 3.2 use, which
# Megatron-Core fixes (only the factor is a flag) and Hugging Face's "llama3" rope type
# records as low_freq_factor, high_freq_factor and original_max_position_embeddings.
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
    high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
    original_context: int = LLAMA3_ORIGINAL_CONTEXT,
) -> torch.Tensor:
    """rope's inverse frequencies scaled by Llama 3.x's rule (Megatron's --use-rope-scaling
    --rope-scaling-factor; Hugging Face's rope type "llama3"). A frequency whose wavelength
    2 pi / f is longer than original_context / low_freq_factor turned less than once over the
    original context: it is divided by ``factor``, so that a context ``factor`` times longer
    turns it no further than training did. One shorter than original_context / high_freq_factor
    turned several times: it is kept, so nearby positions stay as distinguishable. Between the
    two the frequency blends linearly in original_context / wavelength (the number of turns
    over the original context) from f / factor to f."""
    # Turns over the original context, computed through the wavelength as Megatron-Core and
    # transformers compute it, so that the three agree to the last bit.
    turns = original_context / (2 * math.pi / inv_freq)
    # 0 at the slow end (fully divided), 1 at the fast end (kept), clamped beyond either.
    keep = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / factor + keep * inv_freq


def rotary(
    seq: int,
    dim: int,
    device: torch.device,
    base: float = 10000.0,
    scaling_factor: float | None = None,
    interpolation_factor: float | None = None,
    yarn: YarnConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, [seq, dim/2]: position p turns pair i by
    p base^(-2i/dim) (RoFormer's, base 10000 by default as Megatron's --rotary-base); with
    ``scaling_factor`` those frequencies first scaled by Llama 3.x's rule (llama3_inv_freq);
    with ``interpolation_factor`` F position p turns as p / F would (position interpolation,
    Megatron's --rotary-seq-len-interpolation-factor); with ``yarn`` (a config whose rope_type
    is "yarn"; GPTConfig refuses it beside the other two) YaRN's frequencies, and cos and sin
    times its concentration factor (models.yarn)."""
    if yarn is not None:
        inv = yarn_inv_freq(
            dim,
            base,
            yarn.yarn_rotary_scaling_factor,
            yarn.yarn_original_max_position_embeddings,
            yarn.yarn_beta_fast,
            yarn.yarn_beta_slow,
            yarn.yarn_correction_range_round_to_int,
            device,
        )
        angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
        m = yarn_concentration(
            yarn.yarn_rotary_scaling_factor, yarn.yarn_mscale, yarn.yarn_mscale_all_dim
        )
        # fp32 times the factor, as Megatron-Core and transformers multiply them.
        return angles.cos() * m, angles.sin() * m
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if scaling_factor is not None:
        inv = llama3_inv_freq(inv, scaling_factor)
    positions = torch.arange(seq, device=device, dtype=torch.float32)
    if interpolation_factor is not None:
        # Times the reciprocal, in float32, as Megatron-Core's RotaryEmbedding computes it, so
        # that the angles are its to the bit (Hugging Face divides the frequencies instead:
        # the same angles to a few units in the last place).
        positions = positions * (1 / interpolation_factor)
    angles = torch.outer(positions, inv)
    return angles.cos(), angles.sin()


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotates pairs of the last dimension of x [b, heads, s, d]: (x[i], x[i + d/2]) (the
    halves, Megatron-LM's and Hugging Face Llama's default), or with ``interleaved`` adjacent
    (x[2i], x[2i+1]) (Megatron's --rotary-interleaved, and megart's rotation before it).
    Where cos and sin cover fewer channels than x has (partial rotary, Megatron's
    --rotary-percent), only the first 2 cos.shape[-1] channels turn, paired among themselves
    as above, and the rest pass unchanged. Computed in fp32, or in x's type where it is wider
    (float64, as Megatron-Core computes in it)."""
    turned = 2 * cos.shape[-1]
    if turned < x.shape[-1]:
        rest = x[..., turned:]
        return torch.cat((apply_rotary(x[..., :turned], cos, sin, interleaved), rest), dim=-1)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return (
            torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)
        )
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
