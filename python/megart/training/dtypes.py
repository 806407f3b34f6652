"""The dtypes a training configuration's precision flags give (--bf16, --fp16,
--fp32-residual-connection)."""

from __future__ import annotations

from typing import Any

import torch


def half_dtype(config: Any) -> torch.dtype | None:
    """The 16-bit type of --bf16 or --fp16 (what autocast computes in), None without either."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def residual_dtype(config: Any) -> torch.dtype:
    """The dtype of the residual stream, which is what crosses pipeline stages: the 16-bit type
    under --bf16/--fp16 unless --fp32-residual-connection, else fp32 (see GPTConfig)."""
    half = half_dtype(config)
    return torch.float32 if half is None or config.fp32_residual_connection else half
