"""A ring step's block under a sliding window, cut into pieces for the fused masked kernels
(megart.models.flash_blocks.masked_forward and masked_backward; the ring,
megart.models.ring_attention, folds each piece's output by its log-sum-exp).

Under the load-balanced split a rank's tokens are two runs of consecutive positions (chunks r
and 2 cp - 1 - r, megart.models.context_parallel), and so are a visiting block's: a block is
at most four (query run, key run) pairs. In a pair whose first query sits ``delta`` positions
after its first key, query i sees key j when 0 <= delta + i - j <= window (causal, and at most
``window`` tokens back: megart.models.window), so the rows that see some key of the pair are
one interval of i and the keys seen by some row one interval of j. Each pair is cut to those
two intervals (a Piece); a pair with none is not computed, nor is a block without pieces (it
still travels: the ring's exchanges are the same at every step).

Where the window is short against a chunk, a query run is first cut into tiles of T rows
(megart.models.window_tiles.band_tile, as a windowed layer's query tiles), so that a piece on
the diagonal scores T x (T + window) entries rather than a whole chunk's square: the kernels
take a bias but do not skip the parts of it that mask everything.

So every row a kernel is given has a key in its window. Both kernels return a row whose keys
are all masked with log-sum-exp 0 (not -inf) and output 0, which the fold would count as a
part of weight exp(0); the explicit blocks' -inf for such a row (folded as nothing) is here
the row's absence from the piece.

A piece is given its mask as an additive bias in the attention's dtype (0 where allowed, -inf
elsewhere), which depends only on the piece's shape, its ``delta`` and the window: made once
and cached (piece_bias), shared by every layer, step and microbatch that has a piece of that
shape. A piece where every row sees every key needs none, and one that is exactly causal (a
square piece on the diagonal, the window not cutting it) takes the kernel's own causal mask.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megart.models.context_parallel import cp_chunks
from megart.models.window_masks import additive_bias, window_mask
from megart.models.window_tiles import band_tile


@dataclass(frozen=True)
class Piece:
    """Rows of the rank's queries and keys of the visiting block (local indices) whose pairs
    within the window are all the allowed pairs of one (query run, key run); ``delta``: the
    first row's position minus the first key's."""

    rows: slice
    keys: slice
    delta: int
    full: bool  # every row sees every key: no mask
    causal: bool  # key j seen by row i when j <= i (square): the kernel's causal mask

    def bias(self, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The piece's additive bias ([rows, keys], cached), None where ``full`` or ``causal``."""
        if self.full or self.causal:
            return None
        n_rows, n_keys = self.rows.stop - self.rows.start, self.keys.stop - self.keys.start
        return piece_bias(n_rows, n_keys, self.delta, window, dtype, device)


def position_runs(seq: int, cp: int, rank: int, part: slice) -> list[tuple[int, int, int]]:
    """``rank``'s tokens ``part`` (local indices) of a ``seq``-token sequence as maximal runs of
    consecutive global positions: (first index, first position, length) each. Its two chunks
    (context_parallel.cp_chunks, of seq / (2 cp) tokens each) in local order, one run where
    they meet (rank cp - 1's chunks cp - 1 and cp). Arithmetic only, so that megart plan
    counts the same pieces (plan.ring_window_cost) without building positions."""
    half = seq // (2 * cp)
    runs: list[tuple[int, int, int]] = []
    for c, chunk in enumerate(cp_chunks(cp, rank)):
        lo, hi = max(part.start, c * half), min(part.stop, (c + 1) * half)
        if lo >= hi:
            continue
        pos = chunk * half + lo - c * half
        if runs and runs[-1][0] + runs[-1][2] == lo and runs[-1][1] + runs[-1][2] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + hi - lo)
        else:
            runs.append((lo, pos, hi - lo))
    return runs


def _tiles(run: tuple[int, int, int], window: int) -> list[tuple[int, int, int]]:
    """A query run in tiles of T rows where a short window makes tiling pay (band_tile, as a
    windowed layer's query tiles): each tile is then cut to the T + window keys it reaches,
    and the full-width tiles on the diagonal share one bias."""
    first, pos, n = run
    tile = band_tile(n, window)
    if tile is None:
        return [run]
    return [(first + a, pos + a, min(tile, n - a)) for a in range(0, n, tile)]


def cut(q_run: tuple[int, int, int], k_run: tuple[int, int, int], window: int) -> Piece | None:
    """The piece of a query run against a key run (see the module's docstring), or None when
    no query of the run sees a key of the other."""
    (qi, qpos, nq), (ki, kpos, nk) = q_run, k_run
    delta = qpos - kpos
    # Row i sees some key iff delta + i >= 0 and delta + i - window <= nk - 1; key j is seen
    # by some row iff j - delta <= nq - 1 and j - delta + window >= 0.
    lo_i, hi_i = max(0, -delta), min(nq, nk + window - delta)
    lo_j, hi_j = max(0, delta - window), min(nk, nq + delta)
    if lo_i >= hi_i or lo_j >= hi_j:
        return None
    rows, keys = hi_i - lo_i, hi_j - lo_j
    d = delta + lo_i - lo_j  # 0 <= d <= window: the first row sees the first key
    full = d - (keys - 1) >= 0 and d + rows - 1 <= window
    causal = not full and d == 0 and rows == keys and rows - 1 <= window
    return Piece(slice(qi + lo_i, qi + hi_i), slice(ki + lo_j, ki + hi_j), d, full, causal)


def pieces(
    step: int, cp: int, rank: int, local: int, rows: slice, keys: slice, window: int
) -> tuple[Piece, ...]:
    """The pieces of ``rank``'s block at ``step`` of the ring (block_of's ``rows`` of its
    queries against ``keys`` of rank - step's), in order; none when the block lies wholly
    outside the window. Host arithmetic on positions, made once per block (cached)."""
    return _pieces(step, cp, rank, local, rows.start, rows.stop, keys.start, keys.stop, window)


@functools.lru_cache(maxsize=256)
def _pieces(
    step: int, cp: int, rank: int, local: int, r0: int, r1: int, k0: int, k1: int, window: int
) -> tuple[Piece, ...]:
    return block_pieces(step, cp, rank, local, slice(r0, r1), slice(k0, k1), window)


def block_pieces(
    step: int, cp: int, rank: int, local: int, rows: slice, keys: slice, window: int
) -> tuple[Piece, ...]:
    """``pieces``, uncached: host arithmetic only (megart plan counts them, and visits more
    blocks than the runtime's cache holds)."""
    seq, owner = local * cp, (rank - step) % cp
    out = []
    for run in position_runs(seq, cp, rank, rows):
        for q_run in _tiles(run, window):
            for k_run in position_runs(seq, cp, owner, keys):
                if (piece := cut(q_run, k_run, window)) is not None:
                    out.append(piece)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def piece_bias(
    rows: int, keys: int, delta: int, window: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """0 where query i (at position delta + i) sees key j (at j) within ``window``, -inf
    elsewhere: [rows, keys] in ``dtype``, rows ALIGN-strided (window_masks.additive_bias), a
    normal tensor even when first made under inference mode. Read-only."""
    with torch.inference_mode(False):
        positions = torch.arange(max(rows + delta, keys), device=device)
        allowed = window_mask(positions[delta : delta + rows], positions[:keys], window)
        return additive_bias(allowed, dtype)
