"""The ring's windowed layers (--cp-comm-type p2p with --window-size) as megart plan counts them:
what each context-parallel rank's attention core computes, and the biases it caches.

megart train cuts each ring step's block into the pieces inside the window
(models.ring_window: per query run and key run, the rows that see some key and the keys seen,
a short window's query runs first cut in tiles of T = band_tile rows, each tile reaching T +
window keys), and computes each piece by the kernels that take an additive bias
(models.flash_blocks.masked_forward/masked_backward; a piece where every row sees every key
takes none, one exactly causal the kernel's causal mask). The planner takes the pieces from
the same function (ring_window.block_pieces) and counts, per rank:
- entries: the query-key products one head computes over the ring's steps, rows x keys of each
  piece (a causal piece half of them, as flash's causal blocks elsewhere: plan.timing's
  CAUSAL_SHARE). A block with no piece (wholly outside the window) computes nothing, though
  its K/V still travel (ring_attention passes every block on at every step: the ring's
  exchanges, plan.context_parallel.ring_passes, are unchanged).
- bias_reads: elements of the biases its kernel calls read in one pass (each piece's
  [rows, keys] bias, rows ALIGN-strided, broadcast over the batch and heads), the bias read
  per pass that plan.timing counts for --reset-attention-mask's masked call.
- cached: elements of the distinct biases it makes, one per (rows, keys, delta) of the pieces
  that take one (ring_window.piece_bias caches each for the life of the process, in the
  queries' dtype, and shares it among layers, steps and microbatches; the boolean mask it is
  made from is freed). The cache holds PIECE_BIAS_CACHE of them; a rank whose pieces need
  more is counted at that many of its largest (never seen at the sizes tested).

The ranks' counts differ (which chunks meet inside the window depends on the rank); the time
takes the rank with the most entries, as every rank runs its own steps and waits on its
neighbours' exchanges only (plan.timing), and the memory the rank with the most cached bytes.
Blocks are visited only where some key chunk lies within the window of one of the rank's query
chunks (the others have no piece: ring_window.cut returns none for them, checked against every
block in tests/test_plan_ring_window.py), so that a search over large context-parallel sizes
stays cheap.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megart.models.context_parallel import cp_chunks
from megart.models.ring_attention import block_of
from megart.models.ring_window import block_pieces, piece_bias
from megart.models.window_masks import bias_row_stride

PIECE_BIAS_CACHE = piece_bias.cache_info().maxsize or 0
CAUSAL_PIECE = 0.5  # a causal piece: the kernel skips the blocks above the diagonal


@dataclass(frozen=True)
class RankPieces:
    """One rank's windowed ring through one layer, per head and microbatch sample (see the
    module's docstring): query-key ``entries`` computed over the steps, bias elements read per
    pass (``bias_reads``) and held in the cache (``cached``), and the ``unmasked`` pieces (no
    bias: full, or under the kernel's causal mask)."""

    entries: float
    bias_reads: int
    cached: int
    unmasked: int


def _steps_reached(seq: int, cp: int, rank: int, window: int) -> list[int]:
    """The ring steps at which ``rank`` may have a piece: its own block (step 0), and the
    blocks of the ranks that hold a key chunk reaching into the window of one of its query
    chunks (2 cp chunks of seq / (2 cp) tokens, chunk c at positions c half ..)."""
    half = seq // (2 * cp)
    owners = set()
    for qc in cp_chunks(cp, rank):
        first = max(0, (qc * half - window) // half)  # the chunk of the earliest key seen
        owners |= {kc if kc < cp else 2 * cp - 1 - kc for kc in range(first, qc + 1)}
    return sorted({0} | {(rank - o) % cp for o in owners})


def rank_pieces(seq: int, cp: int, rank: int, window: int) -> RankPieces:
    """``rank``'s count (see RankPieces) for a ``seq``-token sequence under a window of
    ``window`` earlier tokens."""
    local = seq // cp
    entries, reads, unmasked, shapes = 0.0, 0, 0, set()
    for step in _steps_reached(seq, cp, rank, window):
        rows, keys, _ = block_of(step, cp, rank, local)
        for p in block_pieces(step, cp, rank, local, rows, keys, window):
            n_rows, n_keys = p.rows.stop - p.rows.start, p.keys.stop - p.keys.start
            entries += n_rows * n_keys * (CAUSAL_PIECE if p.causal else 1.0)
            if p.full or p.causal:
                unmasked += 1
            else:
                reads += n_rows * bias_row_stride(n_keys)
                shapes.add((n_rows, n_keys, p.delta))
    held = sorted((r * bias_row_stride(k) for r, k, _ in shapes), reverse=True)
    return RankPieces(entries, reads, sum(held[:PIECE_BIAS_CACHE]), unmasked)


@functools.lru_cache(maxsize=64)
def ring_pieces(seq: int, cp: int, window: int) -> tuple[RankPieces, ...]:
    """Every rank's count, rank 0 first."""
    return tuple(rank_pieces(seq, cp, r, window) for r in range(cp))


def ring_window_share(seq: int, cp: int, window: int) -> float:
    """The share of a rank's (s/cp) x s query-key products that the busiest rank's pieces
    compute (plan.timing scales the attention core's products by it)."""
    most = max(r.entries for r in ring_pieces(seq, cp, window))
    return most / (seq // cp * seq)


def ring_bias_reads(seq: int, cp: int, window: int) -> int:
    """Bias elements the busiest rank's (the most entries') pieces read in one pass."""
    return max(ring_pieces(seq, cp, window), key=lambda r: r.entries).bias_reads


def ring_cached_bias(seq: int, cp: int, window: int) -> int:
    """Elements of the largest cache of piece biases among the ranks."""
    return max(r.cached for r in ring_pieces(seq, cp, window))
