"""What sliding-window attention (--window-size, --window-attn-skip-freq; megart.models.window)
adds to a rank's memory, as megart train holds it.

A layer whose window masks something (models.window.covers) runs one of two paths, by
models.window_tiles.band_tile (tiles when the sequence is at least twice a tile's key range):
- one bias: a single SDPA call under the s x s additive bias sliding_causal_bias, in the
  attention's dtype, rows ALIGN-strided (s x bias_row_stride(s) elements), made from the
  boolean s x s sliding_causal_mask. Both are cached (models.window_masks) and live as long as
  the process: once per rank. Every windowed layer and pair saves the same bias: nothing more
  per pair.
- tiles: the queries in tiles of T, each its own SDPA call over the keys its windows reach,
  under a slice of the cached band bias (band_bias, T x bias_row_stride(T + left)) made from
  the boolean band_mask (T x (T + left)): both once per rank. Per (microbatch, chunk) pair each
  tiled layer keeps one attention output more than one call's: the tiles' outputs, which
  their calls save (s rows in all), are concatenated into a new [b, heads, s, d] tensor that
  the projection's [s, b, h] input copies, where one call's output, laid out as q, would be
  the projection's input as a view (b s h/t elements). With rope q is rope's [b, heads, s, d]
  output and the projection's input a copy already (activations.attention_elements), and
  under selective recomputation the tiles' outputs are recomputed, not kept: nothing more.
  Under full recomputation nothing is kept until the replay, which saves what the layer would
  without recomputation, the extra output among them (plan.recompute_memory); block's kept
  layers keep it from their forward.

A rank holds the cached tensors when one of its layers is windowed (a rank of full-attention
layers only has none), and each pair the extra outputs of its chunk's tiled layers: with
interleaved chunks that differ in windows, the pairs of each chunk held at the rank's peak
(held_by_chunk, from megart's schedule). Under the all-to-all exchange (--cp-comm-type a2a)
each rank attends over the whole sequence (models.window.sequence_attention): the same cached
tensors, no extra output (the projection's input is a copy of the exchanged output anyway;
measured). Under all_gather every windowed layer takes one cached bias of the rank's
(s/cp) x s (context_parallel.causal_bias; the boolean mask it is made from is freed), counted
once a rank; unmeasured, since a CPU caches such a bias without a window too, and what a
GPU's masked call keeps per pair beside the blockwise flash calls it replaces is the
context-parallel count's own, unaudited (plan.activations). Under the ring (p2p) each rank
caches one bias per shape of its pieces inside the window (models.ring_window.piece_bias; the
boolean mask it is made from is freed), counted once a rank (plan.ring_window_cost, the cp
rank with the most), and its pairs keep what the ring keeps without a window (the pieces'
kernels save nothing through autograd: the ring's own function keeps q, k, v, the output and
its log-sum-exp; a GPU's per-piece random state, two scalars, is not counted). Not modelled:
under torch's math kernel (unfused attention) the tiles' scores, fewer than the s x s counted; and
zero-bubble schedules pick their peak moment (holding.peaks) from pair bytes without the
window's. --runtime megatron refuses the window (plan.flags).

Measured on real CPU ranks (tests/test_plan_window_memory.py: saved-tensor hooks, and the
cached biases and masks held for as long as they live). What a GPU's kernels keep is a model,
unverified on a GPU. One bias: no flash kernel takes a mask tensor, so torch runs the
memory-efficient kernel with the bias, which saves it as a view of the cached one when its
rows are 16-aligned (hence ALIGN): the same bytes as a CPU. Its output is laid out
sequence-major whatever q's layout, so that with rope the projection's input is a view rather
than the copy counted (h/t per token fewer, not modelled, as for fp32 runs). Tiles: each
tile's output is saved by its call as on a CPU, and their concatenation, contiguous in
[b, heads, s, d], is copied by the projection's input as on a CPU: the same extra output. A
tile's bias is a view of the band with aligned rows, but the tiles before the window's first
full width (first query < left) start mid-row: if the kernel wants the start aligned too,
torch would pad a copy per such call (unmeasured; not counted).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from megart.models.config import GPTConfig
from megart.models.window import covers
from megart.models.window_masks import bias_row_stride
from megart.models.window_tiles import band_tile
from megart.plan.activations import Precision
from megart.plan.layout import Layout
from megart.plan.pipeline_run import schedule_of
from megart.plan.recompute_memory import chunk_layer_bytes
from megart.plan.ring_window_cost import ring_cached_bias
from megart.training.config import TrainConfig
from megart.training.layer_placement import rank_layers


def masking_window(cfg: GPTConfig, layer: int) -> int | None:
    """The window of ``layer`` (0-based) if it masks something of the sequence, else None."""
    left = cfg.layer_window(layer)
    return None if covers(left, cfg.seq_length) else left


def _whole_sequence(cfg: GPTConfig, cp: int) -> bool:
    """Whether each rank's windowed attention runs over the whole sequence in its order
    (models.window.sequence_attention): one process, and the all-to-all's heads."""
    return cp == 1 or cfg.cp_comm_type == "a2a"


def once_bytes(cfg: GPTConfig, layers: Sequence[int], prec: Precision, cp: int = 1) -> float:
    """The window's cached tensors on a rank holding ``layers`` (model indices): the bias in
    the attention's dtype (``prec.other``), rows ALIGN-strided, and the boolean mask it was
    made from (the module's doc); none without a masking window among them."""
    if cfg.window_size is None:  # no window: the common case, without a look at each layer
        return 0.0
    windows = {masking_window(cfg, i) for i in layers} - {None}
    if not windows:
        return 0.0
    (left,) = windows  # every windowed layer has --window-size's
    s = cfg.seq_length
    if not _whole_sequence(cfg, cp):
        if cfg.cp_comm_type == "all_gather":  # a rank's (s/cp) x s bias; its mask is freed
            return s // cp * bias_row_stride(s) * prec.other
        return ring_cached_bias(s, cp, left) * prec.other  # the ring's pieces' biases
    tile = band_tile(s, left)
    if tile is None:
        return s * bias_row_stride(s) * prec.other + s * s
    return tile * bias_row_stride(tile + left) * prec.other + tile * (tile + left)


def layer_extra(cfg: GPTConfig, layer: int, b: int, tp: int, prec: Precision, cp: int = 1) -> float:
    """What layer ``layer``'s saves without recomputation add per (microbatch, chunk) pair to
    activations.layer_bytes' count: a tiled layer's second attention output, b s h/t elements
    in the attention's dtype, unless rope's q made the projection's input a copy already (the
    module's doc). Selective recomputation keeps none of it; full recomputation's replay makes
    it (recompute_memory.chunk_layer_bytes)."""
    left = masking_window(cfg, layer)
    if left is None or cp > 1 or cfg.position_embedding == "rotary":
        return 0.0
    s = cfg.seq_length
    return 0.0 if band_tile(s, left) is None else b * s * cfg.query_size / tp * prec.other


def rank_layer_bytes(
    c: TrainConfig,
    cfg: GPTConfig,
    layout: Layout,
    dp: int,
    pp_rank: int,
    pairs: int,
    prec: Precision,
    unfused_attention: bool = False,
    expert_tokens: float = 1.0,
) -> tuple[float, float, float]:
    """Pipeline rank ``pp_rank``'s layers with ``pairs`` (microbatch, chunk) pairs held: (the
    bytes the pairs' layers keep, how far above them a backward rises while full
    recomputation replays a span, the window's cached tensors), each chunk with its own
    layers' windows (training.layer_placement), the pairs of each chunk as the schedule holds
    them at the rank's peak (held_by_chunk). The rise is the highest chunk's: a rank's
    backwards start with its most pairs held, whichever chunk they replay. ``cfg``: c's
    model (c.gpt_config(), which the caller has). ``expert_tokens``: under expert parallelism,
    the token copies this rank's experts get, in k T a microbatch (plan.moe_memory)."""
    t, p, v, b, sp = layout.sizes()
    cp = layout.cp
    chunks = rank_layers(c, pp_rank)

    def extras(chunk: range) -> list[float]:  # none without a window: the common case, fast
        if cfg.window_size is None:
            return []
        return [layer_extra(cfg, i, b, t, prec, cp) for i in chunk]

    def moe(chunk: range) -> list[bool]:  # each layer's kind: dense unless --num-experts
        return [cfg.is_moe_layer(i) for i in chunk] if cfg.num_experts else []

    per_chunk = [
        chunk_layer_bytes(
            cfg,
            b,
            t,
            sp,
            prec,
            len(chunk),
            unfused_attention,
            cp,
            extras(chunk),
            moe(chunk),
            2 if c.half_weights and (c.bf16 or c.fp16) else 4,
            layout.ep,
            expert_tokens,
        )  # fmt: skip
        for chunk in chunks
    ]
    kept = tuple(k for k, _ in per_chunk)
    if len(set(kept)) == 1:
        held = pairs * kept[0]
    else:
        counts = held_by_chunk(layout.kind, p, c.microbatches(dp), v, pp_rank, pairs, kept)
        held = sum(n * k for n, k in zip(counts, kept, strict=True))
    once = once_bytes(cfg, [i for chunk in chunks for i in chunk], prec, cp)
    return held, max(r for _, r in per_chunk), once


@functools.lru_cache(maxsize=256)
def held_by_chunk(kind: str, p: int, m: int, v: int, rank: int, pairs: int,
                  weights: tuple[float, ...]) -> tuple[int, ...]:  # fmt: skip
    """The pairs of each of rank ``rank``'s ``v`` chunks held when it holds ``pairs`` between
    forward and backward (or I) under megart's schedule ``kind``: of the moments it does, the
    one whose pairs weigh the most (``weights``: bytes per pair of each chunk). Where the
    schedule never holds that many (a count from theory), all ``pairs`` of the heaviest chunk."""
    if v == 1:
        return (pairs,)
    counts, best, most = [0] * v, None, -1.0
    for a in schedule_of(kind, p, m, v).ranks[rank]:
        if a.op not in ("F", "B", "I"):
            continue
        counts[a.chunk] += 1 if a.op == "F" else -1
        weight = sum(n * w for n, w in zip(counts, weights, strict=True))
        if sum(counts) == pairs and weight > most:
            best, most = tuple(counts), weight
    if best is None:
        heaviest = max(range(v), key=lambda k: weights[k])
        best = tuple(pairs if k == heaviest else 0 for k in range(v))
    return best
