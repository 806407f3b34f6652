"""Sliding-window attention in query tiles (band attention), without an s x s mask.

A query at position i with a window of ``left`` earlier tokens reads keys i - left .. i only.
The queries are cut into tiles of T tokens; the tile [a, a + n) reads the contiguous keys
[max(0, a - left), a + n), at most T + left of them, through one SDPA call with a [n, keys]
mask. For a full-width tile (a >= left, n = T) that mask is the same whatever a: query row r
(position a + r) may read key column c (position a - left + c) when r <= c <= r + left. It is
built once per (T, left, device), and as an additive bias once per dtype too (band_mask,
band_bias: megart.models.window_masks); a tile near the start (a < left, keys from 0) takes its
columns from left - a on, and the last, shorter tile its first n rows: views, no copy.
Documents (--reset-attention-mask) take the same slice of their [b, 1, s, s] mask.

Each tile scores n x keys entries against the whole sequence's s x s for one masked call: the
saving is about s / (T + left), and the largest tensor a tile makes (its scores under torch's
math kernel) is
b x heads x T x (T + left) instead of b x heads x s x s. Dropout draws per tile (each call its
own draw from the same generator, in tile order, so a replay under recomputation redraws the
same masks).

megart.plan counts the same entries (scored_entries) for a windowed layer's attention time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megart.models.window_masks import as_bias, band_bias, bias_dtype

# The smallest tile. A tile of T queries scores T x (T + left) entries of which about
# T x (left + 1) are inside the windows (less T^2 / 2 of the triangle no query reaches): the
# wasted share is about (T - 1) / (T + left), a half at T = left + 1, fewer with smaller tiles;
# but each tile is one kernel call whose products have T rows, and a GPU's matrix units run
# products of fewer than a few hundred rows well below their peak (plan.timing's gemm
# efficiency m / (m + gemm_half_dim)), so tiles stay at least this long for small windows.
TILE_FLOOR = 256


def band_tile(seq: int, left: int) -> int | None:
    """The tile length for a ``seq``-token sequence under a window of ``left`` earlier tokens,
    or None where tiling would not pay: T = max(left + 1, TILE_FLOOR) (a wasted share of about
    a half for large windows, see TILE_FLOOR), tiled only when the sequence is at least twice
    a tile's key range (T + left), that is when the tiles score at most half the s x s entries
    a single mask would."""
    if left < 0:
        return None
    tile = max(left + 1, TILE_FLOOR)
    return tile if seq >= 2 * (tile + left) else None


def band_tiles(seq: int, left: int, tile: int) -> list[tuple[int, int, int]]:
    """(first query, query count, first key) of each tile: queries [a, a + n) read keys
    [first key, a + n)."""
    return [(a, min(tile, seq - a), max(0, a - left)) for a in range(0, seq, tile)]


def scored_entries(seq: int, left: int, tile: int | None) -> int:
    """Query-key entries one head's windowed attention scores over a ``seq``-token sequence:
    the tiles' n x keys, or all seq x seq for one masked call (``tile`` None)."""
    if tile is None:
        return seq * seq
    return sum(n * (a + n - first) for a, n, first in band_tiles(seq, left, tile))


def tiled_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    left: int,
    tile: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within ``left`` earlier tokens ([b, heads, s, d], keys and values
    repeated per query head), and where ``mask`` ([b or 1, 1, s, s], True: may attend, or its
    additive bias) allows, in query tiles of ``tile`` tokens."""
    seq = q.shape[2]
    # The cached band bias (one tensor that every call keeps, window_masks); with documents,
    # each tile's sum of the band and the documents' bias.
    band = band_bias(tile, left, bias_dtype(q), q.device)
    if mask is not None:
        mask = as_bias(mask, bias_dtype(q))
    out = []
    for a, n, first in band_tiles(seq, left, tile):
        offset = left - (a - first)  # the columns before position 0 that this tile lacks
        allowed = band[:n, offset : offset + a + n - first]
        if mask is not None:
            allowed = mask[..., a : a + n, first : a + n] + allowed
        keys, values = k[:, :, first : a + n], v[:, :, first : a + n]
        out.append(F.scaled_dot_product_attention(q[:, :, a : a + n], keys, values, allowed,
                                                  dropout_p=dropout))  # fmt: skip
    return torch.cat(out, dim=2)
