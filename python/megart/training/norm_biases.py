"""Checkpoint files megart wrote before its LayerNorms kept their bias under
--disable-bias-linear.

megart used to drop LayerNorm's bias together with the linear layers' (Megatron-Core keeps it:
--disable-bias-linear is add_bias_linear=False alone). Such a file's model (recorded as
normalization "layernorm" with bias False) has every LayerNorm weight without its bias. A zero
bias computes exactly what no bias did, so a file of that layout is read as one whose norm
biases are zero: the model chunks get zero biases, and the optimizer state names them in its
undecayed param group without state, so that Adam starts their moments (and
their step count) afresh while every other parameter resumes its own.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# The LayerNorms of a megart model chunk: the layers' input, pre-MLP and --qk-layernorm ones,
# and the final norm.
_LAYER_NORM_WEIGHT = re.compile(
    r"^(?:blocks\.\d+\.(?:ln_1|ln_2|attn\.q_layernorm|attn\.k_layernorm)|ln_f)\.weight$"
)


def dropped_norm_biases(model_config: dict[str, Any] | None) -> bool:
    """Whether a file's recorded model is one whose LayerNorms megart once built without a
    bias: LayerNorm with --disable-bias-linear."""
    return bool(
        model_config
        and model_config.get("normalization") == "layernorm"
        and model_config.get("bias") is False
    )


def _missing(chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each LayerNorm weight of ``chunk`` without its bias, by the bias's name."""
    out = {}
    for name, weight in chunk.items():
        bias = name.removesuffix("weight") + "bias"
        if _LAYER_NORM_WEIGHT.match(name) and bias not in chunk:
            out[bias] = weight
    return out


def add_zero_norm_biases(state: dict[str, Any]) -> list[str]:
    """Completes file ``state`` (megart's format, in place) where it lacks LayerNorm biases
    (see the module's docstring): returns the names added, chunk by chunk, none for a file of
    any other layout."""
    if not dropped_norm_biases(state.get("model_config")):
        return []
    added: list[tuple[int, str]] = []
    for c, chunk in enumerate(state["model"]):
        for name, weight in _missing(chunk).items():
            chunk[name] = torch.zeros(weight.shape, dtype=weight.dtype)
            added.append((c, name))
    optimizer = state.get("optimizer")
    if added and optimizer is not None and state.get("optimizer_params"):
        groups = optimizer["param_groups"]
        ids = [i for g in groups for i in g["params"]]
        new = list(range(max(ids, default=-1) + 1, max(ids, default=-1) + 1 + len(added)))
        # The last group is the one without weight decay (biases and norms), whatever others
        # precede it (megart.training.optimizer.param_groups).
        groups[-1] = {**groups[-1], "params": [*groups[-1]["params"], *new]}
        state["optimizer_params"] = [*state["optimizer_params"], *added]
    return [name for _, name in added]


def note(directory: Any, names: list[str]) -> str:
    """The one line a load of such a file prints."""
    return (
        f"megart: {directory} was saved by a megart that built LayerNorm without its bias "
        f"under --disable-bias-linear; its LayerNorm biases ({', '.join(sorted(set(names))[:2])}, "
        "...) start at zero, which computes what no bias did, and their Adam moments start "
        "afresh (megart's LayerNorm now keeps its bias under --disable-bias-linear, as "
        "Megatron-Core's)"
    )
