"""Ring attention: context parallelism's keys and values passed around the group in cp steps
(Megatron-Core's cp_comm_type "p2p", Transformer Engine's AttnFuncWithCPAndKVP2P).

Each context-parallel rank keeps its own queries and, at step i, holds the keys and values of
rank r - i (mod cp): its own at step 0, then each one received from the previous rank while it
sent the block it held to the next. The partial attention of every step is folded into the
output by log-sum-exp (online softmax), in fp32 (float64 stays float64), so that besides its
own a rank holds at most two other ranks' K/V at once (the one it computes with and the one
arriving), never the whole sequence's.

Under the load-balanced split (rank r holds chunks r and 2 cp - 1 - r,
megart.models.context_parallel) causal masking is per block pair: step 0 is the rank's own
block, causal (its tokens are in order); a block from an earlier rank j < r is seen whole by all
the rank's queries, but only its first chunk (j; chunk 2 cp - 1 - j is later than all of them);
a block from a later rank j > r is seen, whole, by the rank's second query chunk only. The steps
after the first each compute half a block's scores.

The backward recomputes each block's scores from the saved queries, the rank's own K/V, the
output and the log-sum-exp (nothing of other ranks' K/V is saved), passing K/V around the ring
again; each block's dK/dV accumulator travels with it, every rank adding its part, and a last
exchange hands it back to its owner. Messages: cp - 1 K/V blocks forward; cp - 1 K/V blocks and
cp dK/dV blocks backward, each to the next rank.

With grouped-query attention the K/V that travel are the groups' (not repeated per head).
Each step's block is computed by torch's flash kernels where they take the queries
(megart.models.flash_blocks: CUDA in fp16/bf16, with dropout; the CPU without dropout): the
forward's block output and log-sum-exp are folded as above, and each block's backward is the
flash backward given the folded output and log-sum-exp. Elsewhere (fp32 on CUDA, dropout on the
CPU) the blocks are explicit products in fp32, in tiles of query rows so that one tile's
scores (TILE_ELEMENTS) exist at a time, however long the sequence; attention dropout then
draws each tile's mask from the current random stream and the backward replays the stream from
its saved state, so that the backward is the forward's own derivative. Either way the dropout
masks are not the one-process attention's (nor are the all-gather path's). On an H200 the flash
blocks computed one rank's ring 14.6 times faster than the explicit ones (bench/ring_flash.py,
bench/RESULTS.md).

With a sliding window (megart.models.window) each step's block is masked by the global
positions of the rank's queries and the visiting block's keys (causal, and within the window),
and a block with no key inside any of its rows' windows is not computed (it still travels: the
ring's exchanges are the same at every step). Where the masked kernels take the queries
(flash_blocks.masked_usable: CUDA in fp16, bf16 and fp32, with dropout, by the memory-efficient
kernel; the CPU without dropout, by its flash kernel) the block is cut into the pieces inside
the window (megart.models.ring_window: per pair of a query chunk and a key chunk, the rows that
see some key and the keys seen), each computed by those kernels given its cached additive bias
and folded as above; no piece has a row without a key in its window (the kernels return such
a row as a part of log-sum-exp 0, where the explicit blocks give -inf, which the fold ignores).
Elsewhere (dropout on the CPU, float64 on CUDA) the blocks are the explicit ones, each tile
masked. The CUDA branch of the masked kernels is unverified on a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.models import flash_blocks
from megart.models.context_parallel import cp_positions
from megart.models.ring_math import _compute_dtype, _expand, _fold, _keep, _scores, tiles
from megart.models.ring_window import pieces
from megart.models.rng_replay import replayed, rng_state
from megart.models.sinks import initial_lse, sink_grad
from megart.models.window_masks import window_mask

# Scores per tile of query rows (fp32: 256 MiB): a step's explicit products never hold more
# than a few tiles' worth, whatever the sequence length.
TILE_ELEMENTS = 1 << 26


def block_of(step: int, cp: int, cp_rank: int, local: int) -> tuple[slice, slice, bool]:
    """At ``step`` of the ring, which of ``cp_rank``'s ``local`` query rows attend to which of
    the visiting block's ``local`` keys, and whether causally: (rows, keys, causal)."""
    half = local // 2
    if step == 0:
        return slice(0, local), slice(0, local), True
    if (cp_rank - step) % cp < cp_rank:  # an earlier rank's block: its first chunk, all rows
        return slice(0, local), slice(0, half), False
    return slice(half, local), slice(0, local), False  # a later rank's: the second chunk's rows


class BlockWindow:
    """A sliding window over one step's block: the global positions of the rank's query
    ``rows`` and of the visiting ``keys`` (rank r - step's), whether any row's window reaches a
    key of the block (decided on the host, without waiting on the device), and each tile's
    mask (built per tile, so that it stays as small as the tile's scores)."""

    def __init__(
        self, step: int, ring: _Ring, local: int, rows: slice, keys: slice, window: int
    ) -> None:
        seq, owner = local * ring.cp, (ring.rank - step) % ring.cp
        queries = cp_positions(seq, ring.cp, ring.rank, None)[rows]
        held = cp_positions(seq, ring.cp, owner, None)[keys]
        ordered = held.sort().values
        # Query q sees the keys in [q - window, q]: some key of the block lies there.
        seen = torch.searchsorted(ordered, queries, right=True)
        self.reaches = bool((seen > torch.searchsorted(ordered, queries - window)).any())
        self.rows, self.window, self.queries, self.keys = rows, window, queries, held

    def mask(self, tile: slice, device: torch.device) -> torch.Tensor:
        """[tile's rows, keys] booleans, True where the key is in the query's window."""
        at = slice(tile.start - self.rows.start, tile.stop - self.rows.start)
        return window_mask(self.queries[at].to(device), self.keys.to(device), self.window)


def block_window(
    step: int, ring: _Ring, local: int, rows: slice, keys: slice, window: int | None
) -> BlockWindow | None:
    """The step's BlockWindow, or None without a window (block_of's causality is the mask)."""
    return None if window is None else BlockWindow(step, ring, local, rows, keys, window)


def _tile_mask(bw: BlockWindow | None, tile: slice, device: torch.device) -> torch.Tensor | None:
    return None if bw is None else bw.mask(tile, device)


class _Ring:
    """One rank's place in the ring: the peers and the exchange of a block with them."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.cp, self.rank = group.size(), group.rank()
        self.next = group.ranks[(self.rank + 1) % self.cp]
        self.prev = group.ranks[(self.rank - 1) % self.cp]

    def pass_on(self, block: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        """Starts sending ``block`` to the next rank and receiving the previous rank's into a
        new tensor; returns it and the ops to wait on before reading it."""
        arriving = torch.empty_like(block)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, block, self.next, self.group),
                dist.P2POp(dist.irecv, arriving, self.prev, self.group),
            ]
        )
        return arriving, works


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries [b, heads, s/cp, d] over the whole sequence,
    given this rank's keys and values [b, groups, s/cp, d] (see the module's docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: ProcessGroup,
        dropout: float,
        tile_elements: int,
        flash: bool,
        window: int | None = None,
        scale: float | None = None,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ring = _Ring(group)
        c = _compute_dtype(q.dtype)
        b, h, local, d = q.shape
        per_group = h // k.shape[1]
        rng = rng_state(q.device) if dropout and not flash else None
        qc = None if flash else q.to(c)  # the explicit products' fp32 queries
        out = torch.zeros(b, h, local, d, dtype=c, device=q.device)
        lse = initial_lse(sink, (b, h, local), c, q.device)  # the sink's logit counted once
        kv = torch.stack([k, v]).contiguous()
        flash_saved = []  # per step, what its flash backward needs of its forward
        for step in range(ring.cp):
            if step + 1 < ring.cp:  # the next block travels while this one is computed
                arriving, works = ring.pass_on(kv)
            rows, keys, causal = block_of(step, ring.cp, ring.rank, local)
            if flash and window is not None:  # the block's pieces inside the window, if any
                saves = []
                for piece in pieces(step, ring.cp, ring.rank, local, rows, keys, window):
                    kb, vb = (_expand(x[:, :, piece.keys], per_group) for x in kv)
                    bias = piece.bias(window, q.dtype, q.device)
                    part, part_lse, saved = flash_blocks.masked_forward(
                        q[:, :, piece.rows], kb, vb, bias, piece.causal, dropout
                    )
                    saves.append(saved)
                    fold_in(out, lse, piece.rows, part.to(c), part_lse.to(c))
                flash_saved.append(saves)
            elif flash:
                kb, vb = (_expand(x[:, :, keys], per_group) for x in kv)
                block_out, block_lse, saved = flash_blocks.forward(
                    q[:, :, rows], kb, vb, causal, dropout, scale
                )
                flash_saved.append(saved)
                fold_in(out, lse, rows, block_out.to(c), block_lse.to(c))
            elif (bw := block_window(step, ring, local, rows, keys, window)) is None or bw.reaches:
                # (else the block lies wholly outside the window: nothing to fold in)
                kb, vb = (_expand(x[:, :, keys].to(c), per_group) for x in kv)
                for t in tiles(rows, kb.shape[2], b * h, tile_elements):
                    allowed = _tile_mask(bw, t, q.device)
                    s = _scores(qc[:, :, t], kb, t.start if causal else None, allowed, scale)
                    tile_lse = torch.logsumexp(s, dim=-1)
                    # A row with no key of the block in its window: no weight (lse -inf, kept
                    # by the fold; every row has its own key at step 0, so the fold stays finite).
                    p = torch.exp(s - tile_lse.nan_to_num(neginf=0.0).unsqueeze(-1))
                    keep = _keep(p.shape, dropout, p)
                    fold_in(out, lse, t, (p if keep is None else p * keep) @ vb, tile_lse)
            if step + 1 < ring.cp:
                _wait(works)
                kv = arriving
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sink)
        ctx.ring, ctx.dropout, ctx.rng, ctx.tile_elements = ring, dropout, rng, tile_elements
        ctx.window, ctx.scale = window, scale
        ctx.flash_saved = flash_saved if flash else None
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        q, k, v, out, lse, sink = ctx.saved_tensors
        ring, dropout = ctx.ring, ctx.dropout
        c = _compute_dtype(q.dtype)
        h, local = q.shape[1], q.shape[2]
        per_group = h // k.shape[1]
        flash = ctx.flash_saved is not None
        if not flash:  # the explicit products' fp32 operands (the flash kernels take their own)
            qc, doc = q.to(c), dout.to(c)
            delta = (doc * out.to(c)).sum(-1)  # rowsum(dO o O): the softmax's backward term
        dq = torch.zeros(q.shape, dtype=c, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=c, device=kv.device)  # the visiting block's dK, dV
        scale = ctx.scale or 1.0 / math.sqrt(q.shape[-1])
        with replayed(ctx.rng, q.device):
            for step in range(ring.cp):
                if step + 1 < ring.cp:
                    arriving, works = ring.pass_on(kv)
                rows, keys, causal = block_of(step, ring.cp, ring.rank, local)
                if flash and ctx.window is not None:
                    window = ctx.window
                    parts = pieces(step, ring.cp, ring.rank, local, rows, keys, window)
                    for piece, saved in zip(parts, ctx.flash_saved[step], strict=True):
                        kb, vb = (_expand(x[:, :, piece.keys], per_group) for x in kv)
                        dor, qr, outr, lser = (
                            x[:, :, piece.rows].contiguous() for x in (dout, q, out, lse)
                        )
                        bias = piece.bias(window, q.dtype, q.device)
                        dqb, dk, dv = flash_blocks.masked_backward(
                            dor, qr, kb, vb, outr, lser, bias, piece.causal, dropout, saved
                        )
                        dq[:, :, piece.rows] += dqb
                        dkv[0][:, :, piece.keys] += _fold(dk, per_group)
                        dkv[1][:, :, piece.keys] += _fold(dv, per_group)
                elif flash:
                    kb, vb = (_expand(x[:, :, keys], per_group) for x in kv)
                    dor, qr, outr, lser = (x[:, :, rows].contiguous() for x in (dout, q, out, lse))
                    saved = ctx.flash_saved[step]
                    dqb, dk, dv = flash_blocks.backward(
                        dor, qr, kb, vb, outr, lser, causal, dropout, saved, ctx.scale
                    )
                    dq[:, :, rows] += dqb
                    dkv[0][:, :, keys] += _fold(dk, per_group)
                    dkv[1][:, :, keys] += _fold(dv, per_group)
                else:
                    bw = block_window(step, ring, local, rows, keys, ctx.window)
                    kb, vb = (_expand(x[:, :, keys].to(c), per_group) for x in kv)
                    dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
                    skip = bw is not None and not bw.reaches  # wholly outside the window
                    for t in (
                        [] if skip else tiles(rows, kb.shape[2], q.shape[0] * h, ctx.tile_elements)
                    ):
                        qt, dot = qc[:, :, t], doc[:, :, t]
                        allowed = _tile_mask(bw, t, q.device)
                        s = _scores(qt, kb, t.start if causal else None, allowed, ctx.scale)
                        p = torch.exp(s - lse[:, :, t, None])
                        keep = _keep(p.shape, dropout, p)
                        dp = dot @ vb.transpose(-1, -2)
                        if keep is not None:
                            dp = dp * keep
                            p_kept = p * keep
                        else:
                            p_kept = p
                        dv += p_kept.transpose(-1, -2) @ dot
                        ds = p * (dp - delta[:, :, t].unsqueeze(-1))
                        dq[:, :, t] += ds @ kb * scale
                        dk += ds.transpose(-1, -2) @ qt * scale
                    dkv[0][:, :, keys] += _fold(dk, per_group)
                    dkv[1][:, :, keys] += _fold(dv, per_group)
                # The accumulator goes on with its block; the last exchange brings the rank's
                # own block's, complete, back from the previous rank.
                dkv, grad_works = ring.pass_on(dkv)
                _wait(grad_works)
                if step + 1 < ring.cp:
                    _wait(works)
                    kv = arriving
        dsink = sink_grad(sink, lse, out, dout)  # this rank's rows' part
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), *[None] * 6, dsink


def fold_in(
    out: torch.Tensor, lse: torch.Tensor, rows: slice, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Online softmax: ``part``, the attention of ``rows`` over some keys with log-sum-exp
    ``part_lse``, folded into ``out`` and ``lse``, both reweighted to the combined normaliser
    (the ring's fold, which megart selftest and bench/ring_flash.py also call)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, part_lse)
    kept, added = (torch.exp(x - new).unsqueeze(-1) for x in (old, part_lse))
    out[:, :, rows] = out[:, :, rows] * kept + part * added
    lse[:, :, rows] = new


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    dropout: float = 0.0,
    tile_elements: int = TILE_ELEMENTS,
    blocks: str = "auto",
    window: int | None = None,
    *,
    scale: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this context-parallel rank's queries ([b, heads, s/cp, d]) over the
    sequence, from each rank's own keys and values ([b, groups, s/cp, d], heads a multiple of
    groups) passed around ``group`` (see the module's docstring). ``blocks``: "flash" computes
    each step's block with torch's flash kernels (megart.models.flash_blocks), "explicit" with
    explicit products in tiles of query rows of at most ``tile_elements`` scores (see tiles),
    "auto" the first where the kernels take the queries' device, type and dropout. With a
    sliding ``window`` (earlier tokens seen; None: all) "flash" means the masked kernels, each
    block cut into its pieces inside the window (megart.models.ring_window). ``scale``: the
    scores' factor (None: 1/sqrt of the queries' width). Values narrower than the queries
    (multi-latent attention's v_head_dim) travel and are computed zero-padded to the queries'
    width, the padding's output dropped: the blocks' K/V stack and the kernels take one width
    (the zeros add nothing to any output or gradient). ``sink``: each head's sink logit
    (megart.models.sinks), the log-sum-exp's start."""
    if blocks not in ("auto", "flash", "explicit"):
        raise ValueError(f"blocks must be 'auto', 'flash' or 'explicit', not {blocks!r}")
    if window is None:
        usable = flash_blocks.usable(q, dropout)
    else:
        usable = flash_blocks.masked_usable(q, dropout)
    if blocks == "flash" and not usable:
        raise ValueError(
            f"the {'flash' if window is None else 'masked'} kernels do not take {q.dtype} "
            f"queries of head dimension {q.shape[-1]} on {q.device.type} with dropout {dropout}"
        )
    flash = usable if blocks == "auto" else blocks == "flash"
    narrow = q.shape[-1] - v.shape[-1]
    if narrow < 0 or (narrow and window is not None):
        raise NotImplementedError("ring attention with values wider than the queries")
    wide = torch.nn.functional.pad(v, (0, narrow)) if narrow else v
    y = RingAttention.apply(q, k, wide, group, dropout, tile_elements, flash, window, scale, sink)
    return y[..., : v.shape[-1]] if narrow else y
