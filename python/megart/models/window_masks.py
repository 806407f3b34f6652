"""Masks of causal attention within a sliding window, from global positions (True: may attend).

One builder, window_mask, and the two read-only masks made from it once per shape and device:
a whole sequence's (sliding_causal_mask, megart.models.window) and a full-width query tile's
(band_mask, megart.models.window_tiles). Its own module so that both import it: window imports
window_tiles.

Attention takes them as additive biases (0 where allowed, -inf elsewhere: sliding_causal_bias,
band_bias), cached in the dtype the attention runs in. Given a boolean mask, torch's
scaled_dot_product_attention makes that bias itself, a new one per call, which its backward
keeps: every windowed layer and microbatch held its own s x s (or tile x keys) copy until its
backward (measured on the CPU: an fp32 s x s tensor per call). The cached bias is one tensor
that every call keeps instead.
"""

from __future__ import annotations

import functools

import torch

# The cached biases' row stride, in elements: a multiple of 16, so that a GPU's memory-efficient
# kernel (the one that takes a bias) may use the cached rows as they are rather than pad a
# copy of them per call, which torch does for rows not so aligned (a tile's T + left keys
# rarely are). Unverified on a GPU.
ALIGN = 16


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


def bias_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype scaled_dot_product_attention computes ``q`` in: autocast's where it is on for
    q's device (it casts q and the bias to it), else q's own."""
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def bias_row_stride(cols: int) -> int:
    """The row stride, in elements, of a cached bias of ``cols`` keys: cols rounded up to
    ALIGN (megart.plan counts these bytes)."""
    return -(-cols // ALIGN) * ALIGN


def additive_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed`` ([..., queries, keys] booleans), -inf elsewhere, in ``dtype``, its
    rows ALIGN-strided; a normal tensor even when first made under inference mode (callers
    cache it, see _kept_mask)."""
    *lead, cols = allowed.shape
    with torch.inference_mode(False):
        stride = bias_row_stride(cols)
        store = torch.full((*lead, stride), float("-inf"), dtype=dtype, device=allowed.device)
        return store[..., :cols].masked_fill_(allowed, 0.0)


# The last boolean mask given to as_bias, its dtype and its bias: a chunk's layers all take the
# same documents' mask in one forward (megart.models.gpt), so they share one bias.
_last: tuple[torch.Tensor, torch.dtype, torch.Tensor] | None = None


def as_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean ``mask`` (documents') as an additive bias in ``dtype``, the same tensor for
    consecutive calls with the same mask (see the module's docstring); a float mask as given."""
    global _last
    if mask.dtype != torch.bool:
        return mask
    if _last is None or _last[0] is not mask or _last[1] != dtype:
        _last = (mask, dtype, additive_bias(mask, dtype))
    return _last[2]


@functools.lru_cache(maxsize=4)
def sliding_causal_bias(
    length: int, left: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """sliding_causal_mask as an additive bias in ``dtype``, one tensor shared by every call
    (see the module's docstring). Read-only."""
    return additive_bias(sliding_causal_mask(length, left, device), dtype)


@functools.lru_cache(maxsize=8)
def band_bias(tile: int, left: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """band_mask as an additive bias in ``dtype``, shared by every tile and layer. Read-only."""
    return additive_bias(band_mask(tile, left, device), dtype)
