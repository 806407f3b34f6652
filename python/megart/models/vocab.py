"""The vocab-parallel embedding's padded rows, when a checkpoint moves between tensor-parallel
sizes."""

from __future__ import annotations

import torch


def fit_vocab(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocab-parallel embedding's whole weight (or a state shaped like it) with ``rows``
    rows. The vocabulary is padded to a multiple of 128 t (GPTConfig.padded_vocab_size), so the
    padding changes with t; its rows are zero (never looked up, their logits masked out of the
    loss, so their gradients and moments stay zero) and are cut or added as zeros."""
    if weight.shape[0] >= rows:
        return weight[:rows]
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])
