"""Hugging Face's "yarn" rope type (transformers' rope_parameters or rope_scaling) as
GPTConfig's YaRN fields (megart.models.yarn), both ways, for the Llama family's configs.

transformers computes YaRN's frequencies as Megatron-Core does (factor, beta_fast, beta_slow,
original_max_position_embeddings; its truncate is Megatron's
--yarn-correction-range-round-to-int); they differ in the factor multiplying cos and sin.
transformers takes attention_factor where given, else its ratio of mscales only where both
mscale and mscale_all_dim are non-zero, else 0.1 ln(factor) + 1; Megatron-Core always takes the
ratio (its defaults, mscale 1 and mscale_all_dim 0, give that last value). So a config's
attention_factor A is read as --mscale (A - 1) / (0.1 ln factor) with --mscale-all-dim 0 (the
same factor to a unit in the last place), and megart writes mscales transformers would read
otherwise as attention_factor."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from megart.models.yarn import yarn_concentration

if TYPE_CHECKING:
    from megart.models.yarn import YarnConfig


def yarn_from_hf(scaling: dict[str, Any], hf: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(GPTConfig's YaRN fields, what megart cannot take) for a "yarn" rope scaling of config
    ``hf``, with transformers' defaults for what it leaves out."""
    # transformers prefers a top-level original_max_position_embeddings (Phi-3's), then the
    # scaling's, then the model's context.
    original = (
        hf.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings", 2048)
    )
    factor = scaling.get("factor")
    if factor is None:  # transformers' DeepSeek-style reading: the two contexts' ratio
        factor = hf.get("max_position_embeddings", original) / original
    factor = float(factor)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention = scaling.get("attention_factor")
    if attention is None:
        # transformers' ratio only where both are non-zero; else its 0.1 ln(factor) + 1.
        mscales = (mscale, mscale_all_dim) if mscale and mscale_all_dim else (1.0, 0.0)
    elif factor > 1:
        mscales = ((attention - 1) / (0.1 * math.log(factor)), 0.0)
    elif attention == 1:
        mscales = (1.0, 0.0)
    else:
        return {}, (
            f"rope scaling {scaling} (attention_factor {attention} with factor {factor:g}: "
            "Megatron-Core's YaRN, and so megart's, multiplies cos and sin by 1 at a factor of "
            "at most 1)"
        )
    return {
        "rope_type": "yarn",
        "yarn_rotary_scaling_factor": factor,
        "yarn_original_max_position_embeddings": int(original),
        # transformers reads 0 (or none) as the default.
        "yarn_beta_fast": float(scaling.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(scaling.get("beta_slow") or 1.0),
        "yarn_mscale": float(mscales[0]),
        "yarn_mscale_all_dim": float(mscales[1]),
        "yarn_correction_range_round_to_int": bool(scaling.get("truncate", True)),
    }, None


def hf_yarn(cfg: YarnConfig) -> dict[str, Any]:
    """transformers' "yarn" rope scaling for ``cfg``'s YaRN (see the module's docstring for
    how the concentration factor is said)."""
    f, m, a = cfg.yarn_rotary_scaling_factor, cfg.yarn_mscale, cfg.yarn_mscale_all_dim
    if m and a:
        concentration: dict[str, float] = {"mscale": m, "mscale_all_dim": a}
    elif (m, a) == (1.0, 0.0):
        concentration = {}  # transformers' default, 0.1 ln(factor) + 1
    else:
        concentration = {"attention_factor": yarn_concentration(f, m, a)}
    return {
        "rope_type": "yarn",
        "factor": f,
        "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
        "beta_fast": cfg.yarn_beta_fast,
        "beta_slow": cfg.yarn_beta_slow,
        **concentration,
        "truncate": cfg.yarn_correction_range_round_to_int,
    }
