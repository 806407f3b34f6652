"""YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
Models"): rope's frequencies blended between interpolated (divided by the scaling factor) and
extrapolated (kept) per channel pair, and a concentration factor ("mscale", Hugging Face's
attention_factor) multiplying cos and sin. GPTConfig's YaRN fields (YarnConfig) and the two
functions that compute them, kept small so that any attention's rope can use them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("rope", "yarn")
ROUND_FLAG = "yarn-correction-range-round-to-int"


@dataclass(frozen=True)
class YarnConfig:
    """GPTConfig's rope type and YaRN settings, Megatron-Core's names (the attributes its
    GPTModel reads from its config under position_embedding_type "yarn"; Megatron-LM's flags
    --position-embedding-type yarn, --rotary-scaling-factor,
    --yarn-original-max-position-embeddings, --yarn-beta-fast, --yarn-beta-slow, --mscale,
    --mscale-all-dim, --[no-]yarn-correction-range-round-to-int) and defaults (Megatron-LM's,
    those of its YarnRotaryEmbedding). The settings mean nothing with rope_type "rope"."""

    # "rope": rope's frequencies as rotary_base gives them (and Llama 3's scaling, position
    # interpolation); "yarn": YaRN's (models.yarn.yarn_inv_freq) times yarn_concentration.
    rope_type: str = "rope"
    yarn_rotary_scaling_factor: float = 1.0
    # The context the model was trained with before the extension: the blend is by how many
    # turns each pair makes over it.
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True


def correction_range(
    beta_fast: float,
    beta_slow: float,
    dim: int,
    base: float,
    original_context: int,
    round_to_int: bool = True,
) -> tuple[float, float]:
    """(low, high): the channel pairs between which YaRN blends. Pair i of a ``dim``-wide head
    turns original_context / (2 pi base^(2i/dim)) times over the original context; ``low`` is
    the (fractional) pair that turns ``beta_fast`` times, ``high`` the one that turns
    ``beta_slow`` times; rounded outwards (floor, ceil) to whole pairs with ``round_to_int``
    (Hugging Face's truncate), then clamped to 0 and dim - 1 as Megatron-Core and transformers
    clamp them."""

    def pair_turning(turns: float) -> float:
        return dim * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_context: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    round_to_int: bool = True,
    device: torch.device | None = None,
) -> torch.Tensor:
    """YaRN's inverse frequencies of a ``dim``-wide head [dim/2], fp32: pairs before the
    correction range (turning more than beta_fast times over ``original_context``) keep rope's
    frequency base^(-2i/dim) (extrapolated), pairs after it (fewer than beta_slow turns) take
    it divided by ``factor`` (interpolated), and those between blend linearly in the pair's
    index. Computed in the order Megatron-Core's YarnRotaryEmbedding and transformers' "yarn"
    rope type compute it, so that the three agree to the bit."""
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    low, high = correction_range(beta_fast, beta_slow, dim, base, original_context, round_to_int)
    if low == high:
        high += 0.001  # as both do: a step, not a division by zero
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    # 1 where the frequency is kept (extrapolated), 0 where it is divided.
    keep = 1.0 - ramp.clamp(0, 1)
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 mscale ln(factor) + 1 (1 where factor is at most 1): YaRN's temperature rule."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_concentration(factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """The concentration factor that multiplies rope's cos and sin (both the queries' and the
    keys', so the attention logits by its square): yarn_mscale(factor, mscale) over
    yarn_mscale(factor, mscale_all_dim), as Megatron-Core computes it (the defaults give
    0.1 ln(factor) + 1, Hugging Face's attention_factor when it has no mscales)."""
    return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))


def yarn_flags(cfg: YarnConfig) -> str:
    """megart train's (Megatron-LM's) flags of ``cfg``'s YaRN settings, each given (empty
    without YaRN), numbers as exactly as Python writes them: what messages about a model and
    import-hf's command line name."""
    if cfg.rope_type != "yarn":
        return ""

    def number(x: float) -> str:
        return repr(float(x)).removesuffix(".0")

    return (
        f"--rotary-scaling-factor {number(cfg.yarn_rotary_scaling_factor)} "
        f"--yarn-original-max-position-embeddings {cfg.yarn_original_max_position_embeddings} "
        f"--yarn-beta-fast {number(cfg.yarn_beta_fast)} "
        f"--yarn-beta-slow {number(cfg.yarn_beta_slow)} --mscale {number(cfg.yarn_mscale)} "
        f"--mscale-all-dim {number(cfg.yarn_mscale_all_dim)}"
        + (
            ""
            if cfg.yarn_correction_range_round_to_int
            else " --no-yarn-correction-range-round-to-int"
        )
    )
