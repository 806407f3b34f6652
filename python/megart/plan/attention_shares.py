"""How much of a layer's attention products megart computes, as plan.timing counts them:
causal flash's half, its backward's recomputation, a context-parallel rank's explicit share,
and a sliding window's share and bias reads (kept apart from plan.timing, which re-exports
them)."""

from __future__ import annotations

from megart.models.window_masks import bias_row_stride
from megart.models.window_tiles import band_tile, band_tiles, scored_entries

# Flash attention skips the score blocks above a causal mask's diagonal: half the products.
CAUSAL_SHARE = 0.5
# Its backward recomputes the scores: five products of the forward's size to the forward's two
# (FlashAttention-2; on an H200, cuDNN's kernels take 3.2-3.4 times the forward's time,
# bench/layer_profile.py).
FLASH_BACKWARD = 2.5


def cp_score_share(cp: int) -> float:
    """The share of its (s/cp) x s scores that a context-parallel rank's explicit (unfused)
    attention computes: each query chunk's keys up to its own end, (2 cp + 1) / (4 cp) (rank 0's
    first chunk, whose keys are its own, a little less)."""
    return (2 * cp + 1) / (4 * cp)


def window_share(seq: int, left: int, whole_sequence: bool) -> float:
    """The share of the s x s (or, under all_gather, a rank's (s/cp) x s) query-key products
    that a layer with a sliding window of ``left`` earlier tokens computes, as megart runs it:
    over a ``whole_sequence`` (one process; each a2a rank's heads) the query tiles' entries
    (models.window_tiles.scored_entries: about (T + left) / s), or every entry under one
    explicit s x s mask when tiling would not pay; under all_gather the gathered keys' one
    explicit mask (context_parallel.masked_attention): every entry. Either way a masked call
    (the memory-efficient kernel with the mask as a bias on a GPU, or the math kernel) skips
    no block, unlike flash's causal half; its backward recomputes the scores as flash's does
    (FLASH_BACKWARD), or with --attention-backend unfused keeps them (these entries' bytes)."""
    if not whole_sequence:
        return 1.0
    return scored_entries(seq, left, band_tile(seq, left)) / (seq * seq)


def window_bias_reads(seq: int, left: int, whole_sequence: bool, cp: int = 1) -> int:
    """Bias elements a windowed layer's masked calls read in one pass (not the ring's pieces:
    ring_window_cost), rows ALIGN-strided as ring_window_cost counts its pieces' and broadcast
    over the batch and heads: over a ``whole_sequence`` each query tile's [n, keys] slice of
    the cached band bias (models.window_tiles), or the one s x s bias; under all_gather the
    rank's [s/cp, s] bias (context_parallel.masked_attention)."""
    if not whole_sequence:
        return seq // cp * bias_row_stride(seq)
    tile = band_tile(seq, left)
    if tile is None:
        return seq * bias_row_stride(seq)
    return sum(n * bias_row_stride(a + n - first) for a, n, first in band_tiles(seq, left, tile))
