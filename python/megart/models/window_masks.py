"""Masks of causal attention within a sliding window, from global positions (True: may attend).

One builder, window_mask, and the two read-only masks made from it once per shape and device:
a whole sequence's (sliding_causal_mask, megart.models.window) and a full-width query tile's
(band_mask, megart.models.window_tiles). Its own module so that both import it: window imports
window_tiles.
"""

from __future__ import annotations

import functools

import torch


def window_mask(queries: torch.Tensor, keys: torch.Tensor, left: int | None) -> torch.Tensor:
    """[len(queries), len(keys)] booleans (True: may attend) from global positions: key j is
    causal for query i (j <= i) and, with a window, within ``left`` tokens of it (j >= i - left)."""
    q, k = queries.unsqueeze(1), keys.unsqueeze(0)
    allowed = k <= q
    return allowed if left is None else allowed & (k >= q - left)


def _kept_mask(
    first_query: int, queries: int, keys: int, left: int, device: torch.device
) -> torch.Tensor:
    """window_mask of the queries at positions first_query .. first_query + queries - 1 against
    the keys at 0 .. keys - 1, as a normal tensor even when first made under inference mode, so
    that a later training forward may keep it for backward (the masks below are cached)."""
    with torch.inference_mode(False):
        positions = torch.arange(max(first_query + queries, keys), device=device)
        return window_mask(positions[first_query : first_query + queries], positions[:keys], left)


@functools.lru_cache(maxsize=4)
def sliding_causal_mask(length: int, left: int, device: torch.device) -> torch.Tensor:
    """window_mask of a ``length``-token sequence against itself, made once per length, window
    and device: every windowed layer's forward takes (and its backward keeps) the same tensor
    instead of a new s x s mask each. Read-only: callers combine it into new tensors."""
    return _kept_mask(0, length, length, left, device)


@functools.lru_cache(maxsize=8)
def band_mask(tile: int, left: int, device: torch.device) -> torch.Tensor:
    """[tile, tile + left] booleans: row r may read column c when r <= c <= r + left, the
    window of a full-width query tile (megart.models.window_tiles): its queries sit ``left``
    positions after its first key, so row r is the query at position left + r and column c the
    key at position c. Read-only, shared by every tile and layer."""
    return _kept_mask(left, tile, tile + left, left, device)
