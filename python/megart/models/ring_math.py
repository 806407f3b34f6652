"""Ring attention's explicit block products (megart.models.ring_attention): the scores of a
tile of query rows, the tiles, the dropout masks, and the expansion of grouped K/V heads."""

from __future__ import annotations

import math

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _expand(x: torch.Tensor, per_group: int) -> torch.Tensor:
    """Each group's key or value head once per query head of the group."""
    return x.repeat_interleave(per_group, dim=1) if per_group > 1 else x


def _fold(x: torch.Tensor, per_group: int) -> torch.Tensor:
    """The gradient of _expand: each group's heads' gradients summed."""
    if per_group == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // per_group, per_group, n, d).sum(2)


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    first_row: int | None,
    allowed: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q k^T / sqrt(d) (or times ``scale``), in q's (compute) type. ``first_row``: None for
    no mask, else the index in the block of q's first row: key j is masked (-inf) for row i
    when j > first_row + i (causal, both counted from the block's start). ``allowed``: [rows,
    keys] booleans, the mask instead (a sliding window's, BlockWindow.mask)."""
    s = q @ k.transpose(-1, -2) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    if allowed is not None:
        return s.masked_fill(~allowed, float("-inf"))
    if first_row is not None:
        rows = torch.arange(first_row, first_row + q.shape[-2], device=s.device)
        later = torch.arange(k.shape[-2], device=s.device).unsqueeze(0) > rows.unsqueeze(1)
        s = s.masked_fill(later, float("-inf"))
    return s


def tiles(rows: slice, keys: int, heads: int, tile_elements: int) -> list[slice]:
    """``rows`` in tiles of as many query rows as keep one tile's scores ([heads, rows,
    keys], heads counting the batch) within ``tile_elements``: the largest temporary of a
    step is then a tile's, however long the sequence."""
    per_tile = max(1, tile_elements // max(1, heads * keys))
    return [slice(i, min(i + per_tile, rows.stop)) for i in range(rows.start, rows.stop, per_tile)]


def _keep(shape: torch.Size, dropout: float, like: torch.Tensor) -> torch.Tensor | None:
    """A dropout mask, scaled by 1 / (1 - p), drawn from the current random stream."""
    if not dropout:
        return None
    keep = torch.rand(shape, device=like.device, dtype=like.dtype) >= dropout
    return keep.to(like.dtype) / (1.0 - dropout)
