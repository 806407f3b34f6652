"""megart plan through the ring's windowed layers (--cp-comm-type p2p with --window-size at
C > 1; plan.ring_window_cost): the products each rank's pieces compute against a brute-force
cutting of every block from global positions and the window's mask (models.ring_window's
rule: per query run, in tiles of band_tile rows where a short window makes tiling pay, and key
run, the bounding box of the allowed pairs), the time that follows from them, the piece biases
a real CPU rank caches (saved-tensor hooks and the biases held as long as they live,
plan_workers._windows_held) against the plan's memory, and the search, which now picks C > 1."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.launcher import launch
from megart.models import ring_window, window_tiles
from megart.models.context_parallel import cp_positions
from megart.models.ring_attention import block_of
from megart.models.window_masks import bias_row_stride, window_mask
from megart.models.window_tiles import band_tile
from megart.plan import ring_window_cost as rc
from megart.plan.hardware import load_profile
from megart.plan.timing import layer_work
from megart.training.config import TrainConfig
from plan_workers import plan_json
from test_plan_context_parallel import held_in_turn
from test_plan_memory import SMALL
from test_plan_window_memory import _predicted

GPU = load_profile("a100-80gb")


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """(first index, length) of each run of consecutive positions."""
    out: list[list[int]] = []
    for i, p in enumerate(positions):
        if out and p == positions[out[-1][0]] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return [(a, n) for a, n in out]


def brute_force(seq: int, cp: int, rank: int, window: int) -> rc.RankPieces:
    """Every block of ``rank``'s ring, cut from positions: each query run in tiles (band_tile
    of its length), each tile against each key run cut to the rows and keys its window mask
    allows; a box all allowed takes no bias, one exactly lower-triangular the causal mask."""
    local = seq // cp
    entries, reads, unmasked, shapes = 0.0, 0, 0, set()
    for step in range(cp):
        rows, keys, _ = block_of(step, cp, rank, local)
        queries = cp_positions(seq, cp, rank, None)[rows]
        held = cp_positions(seq, cp, (rank - step) % cp, None)[keys]
        key_runs = _runs(held.tolist())
        for a, n in _runs(queries.tolist()):
            tile = band_tile(n, window) or n
            for t in range(a, a + n, tile):
                q = queries[t : min(t + tile, a + n)]
                for k0, nk in key_runs:
                    allowed = window_mask(q, held[k0 : k0 + nk], window)
                    if not allowed.any():
                        continue
                    r = allowed.any(1).nonzero().flatten()
                    c = allowed.any(0).nonzero().flatten()
                    box = allowed[r[0] : r[-1] + 1, c[0] : c[-1] + 1]
                    h, w = box.shape
                    full = bool(box.all())
                    causal = not full and h == w and torch.equal(box, torch.ones(h, h).tril() > 0)
                    entries += h * w * (0.5 if causal else 1.0)
                    if full or causal:
                        unmasked += 1
                    else:
                        reads += h * bias_row_stride(w)
                        shapes.add((h, w, int(q[r[0]] - held[k0 + c[0]])))
    cached = sum(h * bias_row_stride(w) for h, w, _ in shapes)
    return rc.RankPieces(entries, reads, cached, unmasked)


@settings(max_examples=60, deadline=None)
@given(
    cp=st.integers(2, 5),
    half=st.integers(1, 40),
    floor=st.integers(1, 24),
    data=st.data(),
)
def test_the_counted_pieces_are_the_runtimes_cutting_of_every_block(cp, half, floor, data):
    """Against the brute force for every rank, windows from none of the chunk to nearly the
    sequence, the tile floor drawn (window_tiles.TILE_FLOOR) so that tiles of every size
    occur at small sizes; blocks the plan does not visit have no piece."""
    seq = 2 * cp * half
    window = data.draw(st.integers(0, seq - 2), label="window")
    with mock.patch.object(window_tiles, "TILE_FLOOR", floor):
        for rank in range(cp):
            assert rc.rank_pieces(seq, cp, rank, window) == brute_force(seq, cp, rank, window)


def _busiest(seq: int, cp: int, window: int) -> rc.RankPieces:
    return max(rc.ring_pieces(seq, cp, window), key=lambda r: r.entries)


@settings(max_examples=40, deadline=None)
@given(cp=st.sampled_from([2, 4, 8]), half=st.integers(16, 600), data=st.data())
def test_a_larger_window_never_costs_less_time_unless_a_piece_leaves_its_mask(cp, half, data):
    """Per rank the products the kernels are given (causal pieces whole) never fall as the
    window grows; the layer's time neither, except where a piece stops taking a bias (the
    window covers it: no bias read) or becomes exactly causal (the kernel's causal mask: half
    the products), as megart train runs them: a square piece whose window is one token short
    of covering it is computed whole under its bias."""
    seq = 2 * cp * half
    w1 = data.draw(st.integers(0, seq - 3), label="w1")
    w2 = data.draw(st.integers(w1 + 1, seq - 2), label="w2")
    cfg = TrainConfig(**{**SMALL, "seq_length": seq, "context_parallel_size": cp}).gpt_config()
    with mock.patch.object(rc, "CAUSAL_PIECE", 1.0):
        rc.ring_pieces.cache_clear()
        for r in range(cp):
            assert rc.rank_pieces(seq, cp, r, w2).entries >= rc.rank_pieces(seq, cp, r, w1).entries
    rc.ring_pieces.cache_clear()
    times = [layer_work(cfg, 1, 1, False, None, GPU, cp=cp, window=w) for w in (w1, w2)]
    cost = [w.forward + w.backward for w in times]
    if cost[1] < cost[0]:
        one, two = _busiest(seq, cp, w1), _busiest(seq, cp, w2)
        assert two.unmasked > one.unmasked, (w1, w2, one, two)


def test_the_ring_exchange_is_the_same_with_a_window_and_windowed_layers_only_count_pieces():
    """Blocks wholly outside the window still travel: the ring's exchange seconds are those of
    the unwindowed ring; a layer whose window covers the sequence is the flash ring's; and the
    attention core runs the busiest rank's share of the products."""
    seq, cp = 4096, 4
    cfg = TrainConfig(**{**SMALL, "seq_length": seq, "context_parallel_size": cp}).gpt_config()
    plain = layer_work(cfg, 2, 1, False, "selective", GPU, cp=cp)
    windowed = layer_work(cfg, 2, 1, False, "selective", GPU, cp=cp, window=100)
    assert windowed.cp_comm == plain.cp_comm > 0
    assert layer_work(cfg, 2, 1, False, None, GPU, cp=cp, window=seq - 1) == layer_work(
        cfg, 2, 1, False, None, GPU, cp=cp
    )
    assert windowed.forward < plain.forward
    share = rc.ring_window_share(seq, cp, 100)
    assert 0 < share < 0.25 and share == _busiest(seq, cp, 100).entries / (seq // cp * seq)


PLAN = ("--gpu a100-80gb --num-gpus 8 --num-layers 8 --hidden-size 2048 --num-attention-heads 16 "
        "--seq-length 524288 --vocab-size 32000 --global-batch-size 8 --window-size 4095,0 "
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1")  # fmt: skip


def test_the_search_picks_context_parallelism_where_one_rank_cannot_hold_the_sequence(capsys):
    """At 524288 tokens on t1 p1 no layout fits at C = 1 (nor C = 2); under the ring with a
    window the search plans C > 1 and recommends a fitting one; a given
    --context-parallel-size 2 is planned, not refused; the windowed layers cost less than full
    attention at the same layout, and the ring's exchange is the same."""
    out = plan_json(PLAN + " --top 80", capsys)
    fits = {c["layout"]["cp"] for c in out["candidates"] if c["fits"]}
    tried = {c["layout"]["cp"] for c in out["candidates"]}
    assert 1 in tried and 1 not in fits and fits and min(fits) > 1
    assert out["fits"] and out["layout"]["cp"] in fits
    at = out["layout"]["flags"]
    windowed = plan_json(PLAN + " " + at, capsys)
    unwindowed = plan_json(PLAN.replace(" --window-size 4095,0", "") + " " + at, capsys)
    assert windowed["time_s"]["compute"] < unwindowed["time_s"]["compute"]
    assert windowed["time_s"]["cp_comm"] == unwindowed["time_s"]["cp_comm"]
    given = plan_json(PLAN.replace("524288", "32768") + " --context-parallel-size 2", capsys)
    assert given["layout"]["cp"] == 2


def test_layers_the_skip_frequency_leaves_unwindowed_run_the_flash_ring(capsys):
    """--window-attn-skip-freq 2 windows every other layer: the compute lies halfway between
    every layer windowed and none (the layers are otherwise alike, one stage)."""
    base = PLAN.replace("524288", "65536") + " --context-parallel-size 4 --micro-batch-size 1"
    every = plan_json(base, capsys)["time_s"]["compute"]
    half = plan_json(base + " --window-attn-skip-freq 2", capsys)["time_s"]["compute"]
    none = plan_json(base.replace(" --window-size 4095,0", ""), capsys)["time_s"]["compute"]
    assert every < half < none
    assert half == pytest.approx((every + none) / 2, rel=1e-9)


# --- memory against real ranks ------------------------------------------------------------

# A window shorter than a chunk, tiled (chunks of 576 >= 2 (256 + 30): tiles of 256), and
# one longer than a chunk (760 tokens: chunks of 190 at cp2, 95 at cp4).
TILED = {2: dict(seq_length=2304), 4: dict(seq_length=4608)}
SHORT, LONG = dict(window_size="30,0"), dict(window_size="300,0")
ROPE = dict(position_embedding_type="rope")
SEL, FULL = dict(recompute_granularity="selective"), dict(recompute_granularity="full")
BF16 = dict(bf16=True)
# (name, cp, flags)
CASES = [
    ("cp2 fp32 tiles", 2, dict(TILED[2], **SHORT)),
    ("cp2 bf16 tiles rope selective", 2, dict(TILED[2], **SHORT, **ROPE, **SEL, **BF16)),
    ("cp2 fp32 long rope full", 2, dict(seq_length=760, **LONG, **ROPE, **FULL)),
    ("cp2 bf16 long", 2, dict(seq_length=760, **LONG, **BF16)),
    ("cp4 fp32 tiles rope", 4, dict(TILED[4], **SHORT, **ROPE)),
    ("cp4 bf16 tiles full", 4, dict(TILED[4], **SHORT, **FULL, **BF16)),
    ("cp4 fp32 long selective", 4, dict(seq_length=760, **LONG, **SEL)),
    (
        "cp4 bf16 long rope skip",
        4,
        dict(seq_length=760, **LONG, **ROPE, **BF16, window_attn_skip_freq="2"),
    ),  # fmt: skip
]
WINDOW_FLAGS = ("window_size", "window_attn_skip_freq")


@pytest.mark.parametrize("name,cp,flags", CASES, ids=[c[0] for c in CASES])
def test_a_ranks_piece_biases_are_what_the_plan_counts(name, cp, flags):
    """The plan's saved bytes within 1% of the cp rank that holds the most, every rank at most
    1% above them; what the window adds (the same run without it subtracted) is exactly that
    rank's cached piece biases (the ranks' differ), and the plan's addition (the cp rank with
    the most) within 0.1% of the largest rank's. Under full recomputation the replay's moment
    holds the same biases more."""
    kw = {**SMALL, "micro_batch_size": 1, "global_batch_size": 2, "context_parallel_size": cp,
          **flags}  # fmt: skip
    plain = {k: v for k, v in kw.items() if k not in WINDOW_FLAGS}
    ranks = launch(held_in_turn, cp, [kw, plain], timeout=600)
    config = TrainConfig(**kw)
    want, bare_want = _predicted(kw, cp, 0), _predicted(plain, cp, 0)
    size = 2 if kw.get("bf16") else 4
    seq, left = config.seq_length, config.gpt_config().window_size[0]
    added, saved = {}, {}
    for held, bare in ranks:
        r = held["cp_rank"]
        saved[r] = held["saved_peak"]
        assert saved[r] <= want["saved"] * 1.01, (name, r, held, want)
        added[r] = held["saved_peak"] - bare["saved_peak"]
        assert added[r] == rc.rank_pieces(seq, cp, r, left).cached * size, (name, r, added)
        if kw.get("recompute_granularity") == "full":
            assert held["recompute_peak"] - bare["recompute_peak"] == added[r], (name, r)
    assert max(saved.values()) == pytest.approx(want["saved"], rel=0.01), (name, saved, want)
    plan_added = want["saved"] - bare_want["saved"]
    assert plan_added == pytest.approx(max(added.values()), rel=1e-3, abs=0), (name, added)
    assert plan_added > 0


def test_the_rank_pieces_of_the_measured_cases():
    """The figures behind the memory cases (models.ring_window's cutting, elements): which
    rank caches most, and that tiles cache the T x (T + 30) band (256 x 288 padded)."""
    assert band_tile(576, 30) == 256 and bias_row_stride(286) == 288
    tiled = rc.ring_pieces(2304, 2, 30)
    assert all(r.cached >= 256 * 288 for r in tiled)
    assert dataclasses.asdict(tiled[0]).keys() >= {"entries", "bias_reads", "cached"}
    assert ring_window.position_runs(760, 4, 3, slice(0, 190)) == [(0, 285, 190)]
