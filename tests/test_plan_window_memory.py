"""megart plan's memory of sliding-window attention (--window-size, --window-attn-skip-freq;
megart.plan.window_memory) against real megart train ranks (CPU, shared-memory transport): the
activations autograd saves at the peak, with the window's cached bias and boolean mask counted
for as long as they live (plan_workers._windows_held), within 1% as the other memory cases, and
what the window adds (the same run without it subtracted) within 0.1%: the window's bytes are
a few percent of a rank's activations here, so that an error in them (a bias per layer or per
pair, the rows' padding, the tiles' second output, the windows of another rank) would hide
inside 1%. Under full recomputation the same for a replay's moment (RecomputedBytes). One
process, pipelines (interleaved chunks that differ in windows among them) and the all-to-all's
context parallelism (each rank's heads over the whole sequence).

760 tokens: a window of 300 runs one s x s bias (rows padded to 768 elements), one of 100 runs
query tiles of 256 (models.window_tiles.band_tile; 356 keys, padded to 368). What a GPU's
kernels keep is a model (plan.window_memory's doc), not checked here."""

from __future__ import annotations

import pytest

from megart.launcher import launch
from megart.models.window_masks import bias_row_stride
from megart.models.window_tiles import band_tile
from megart.plan import window_memory as wm
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import layout_config
from megart.plan.memory import precision, rank_memory
from megart.training.config import TrainConfig
from plan_workers import held_bytes, plan_json
from test_plan_memory import SMALL, _layout

GPU = load_profile("a100-80gb")
S = 760
# test_plan_memory's model, no dropout (a CPU's math kernel otherwise, plan.activations).
BASE = dict(SMALL, seq_length=S, micro_batch_size=2)
ONE = dict(window_size="300,0")  # 2 (301 + 300) > 760: one s x s bias
TILES = dict(window_size="100,0")  # 760 >= 2 (256 + 100): tiles of 256
PP2 = dict(pipeline_model_parallel_size=2)
# Rank 0 of pp2 holds layers 0-1, rank 1 layers 2-3; interleaved (v 2) rank 0 holds 0 and 2.
FIRST_HALF = dict(window_attn_skip_freq="[1,1,0,0]")  # rank 1 of pp2 holds no window
ONLY_FIRST = dict(window_attn_skip_freq="[1,0,0,0]")  # interleaved: rank 0's chunks differ
INTERLEAVED = dict(PP2, num_layers_per_virtual_pipeline_stage=1)
FULL = dict(recompute_granularity="full")
A2A = dict(context_parallel_size=2, cp_comm_type="a2a")

# (name, processes, flags)
CASES = [
    ("pp1 fp32 one bias", 1, dict(ONE)),
    ("pp1 fp32 tiles", 1, dict(TILES)),
    ("pp1 fp32 tiles selective", 1, dict(TILES, recompute_granularity="selective")),
    ("pp1 fp32 one bias full", 1, dict(ONE, **FULL)),
    ("pp1 fp32 tiles full uniform 2", 1, dict(TILES, **FULL, recompute_num_layers=2)),
    (
        "pp1 fp32 tiles full block 1",
        1,
        dict(TILES, **FULL, recompute_method="block", recompute_num_layers=1),
    ),
    ("pp1 bf16 rope tiles", 1, dict(TILES, bf16=True, position_embedding_type="rope")),
    ("pp2 fp32 tiles skip", 2, dict(TILES, **PP2, **FIRST_HALF)),
    ("pp2 fp32 tiles skip 2", 2, dict(TILES, **PP2, window_attn_skip_freq="2")),
    ("pp2 bf16 tiles skip", 2, dict(TILES, **PP2, **FIRST_HALF, bf16=True)),
    (
        "pp2 bf16 one bias selective",
        2,
        dict(ONE, **PP2, bf16=True, recompute_granularity="selective"),
    ),  # fmt: skip
    ("pp2 interleaved fp32 tiles", 2, dict(TILES, **INTERLEAVED, **ONLY_FIRST)),
    ("pp2 interleaved bf16 one bias", 2, dict(ONE, **INTERLEAVED, **FIRST_HALF, bf16=True)),
    ("pp2 bf16 tiles full", 2, dict(TILES, **PP2, **FIRST_HALF, **FULL, bf16=True)),
    # The all-to-all: each rank's heads over the whole sequence, the same cached tensors.
    ("cp2 a2a fp32 tiles", 2, dict(TILES, **A2A)),
    ("cp2 a2a bf16 one bias", 2, dict(ONE, **A2A, bf16=True)),
]
WINDOW_FLAGS = ("window_size", "window_attn_skip_freq")


def _measure(kw: dict, nproc: int) -> list[dict]:
    return launch(held_bytes, nproc, kw, timeout=300)


def _predicted(kw: dict, nproc: int, pp_rank: int) -> dict:
    """The plan's memory of ``pp_rank`` by part, with the pairs its schedule holds."""
    config = TrainConfig(**kw)
    layout = _layout(config, nproc)
    pairs = estimate(config, layout, GPU).peak_in_flight[pp_rank]
    return rank_memory(layout_config(config, layout), layout, layout.dp, pp_rank, pairs)


@pytest.mark.parametrize("name,nproc,flags", CASES, ids=[c[0] for c in CASES])
def test_what_a_rank_holds_with_a_sliding_window(name, nproc, flags):
    kw = {**BASE, **flags}
    plain = {k: v for k, v in kw.items() if k not in WINDOW_FLAGS}
    windowed, without = _measure(kw, nproc), _measure(plain, nproc)
    full = kw.get("recompute_granularity") == "full"
    for held, bare in zip(windowed, without, strict=True):
        r = held["pp_rank"]
        want, bare_want = _predicted(kw, nproc, r), _predicted(plain, nproc, r)
        assert held["saved_peak"] == pytest.approx(want["saved"], rel=0.01), (name, held, want)
        added = held["saved_peak"] - bare["saved_peak"]
        want_added = want["saved"] - bare_want["saved"]
        assert added == pytest.approx(want_added, rel=1e-3, abs=0), (name, r, added, want_added)
        if not full:
            continue
        top = want["saved"] + want["recompute_working"]
        if want["recompute_working"] == 0:  # block's kept layers held more before: no rise
            assert held["recompute_peak"] <= held["saved_peak"], (name, r, held)
            continue
        # A replay's moment: the kept bytes and one span's saves.
        bare_top = bare_want["saved"] + bare_want["recompute_working"]
        rise = held["recompute_peak"] - bare["recompute_peak"]
        assert rise == pytest.approx(top - bare_top, rel=1e-3, abs=0), (name, r, rise)


def test_the_windows_bytes_by_path_dtype_and_padding():
    """The rule, spelt out: once a rank, one s x s bias (rows padded to 16) and its boolean
    mask, or a tile's band and its mask; per pair, each tiled layer's second output without
    rope and recomputation; nothing for layers whose window covers the sequence."""
    for bf16, size in [(False, 4), (True, 2)]:
        c = TrainConfig(**BASE, **ONE, bf16=bf16)
        cfg, prec = c.gpt_config(), precision(c, "megart")
        assert wm.once_bytes(cfg, range(4), prec) == S * 768 * size + S * S
        c = TrainConfig(**BASE, **TILES, bf16=bf16)
        cfg, prec = c.gpt_config(), precision(c, "megart")
        assert band_tile(S, 100) == 256 and bias_row_stride(356) == 368
        assert wm.once_bytes(cfg, range(4), prec) == 256 * 368 * size + 256 * 356
        assert wm.layer_extra(cfg, 0, 2, 1, prec) == 2 * S * 64 * size
        assert wm.layer_extra(cfg, 0, 2, 2, prec) == S * 64 * size  # h/t
    rope = TrainConfig(**BASE, **TILES, position_embedding_type="rope").gpt_config()
    assert wm.layer_extra(rope, 0, 2, 1, precision(TrainConfig(**BASE), "megart")) == 0
    skip = TrainConfig(**BASE, **TILES, **FIRST_HALF).gpt_config()
    prec = precision(TrainConfig(**BASE), "megart")
    assert wm.once_bytes(skip, [2, 3], prec) == 0 and wm.layer_extra(skip, 2, 2, 1, prec) == 0
    covering = TrainConfig(**BASE, window_size=f"{S - 1},0").gpt_config()
    assert wm.once_bytes(covering, range(4), prec) == 0


def test_interleaved_pairs_by_chunk_follow_the_schedule():
    """Rank 0 of pp2, v 2, 4 microbatches: F0 F0 F1 F1 F0 before its first backward, 5 pairs
    held; of the moments with 5, the one with the most of the heavier chunk."""
    assert wm.held_by_chunk("interleaved", 2, 4, 2, 0, 5, (2.0, 1.0)) == (4, 1)
    assert wm.held_by_chunk("interleaved", 2, 4, 2, 0, 5, (1.0, 2.0)) == (3, 2)
    assert wm.held_by_chunk("1f1b", 2, 4, 1, 0, 2, (1.0,)) == (2,)


BIG = ("--gpu a100-80gb --num-gpus 8 --num-layers 8 --hidden-size 1024 --num-attention-heads 16 "
       "--seq-length 8192 --global-batch-size 64 --tokenizer-type NullTokenizer "
       "--vocab-size 32000 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
       "--context-parallel-size 1 --micro-batch-size 1 --pipeline-schedule 1f1b")  # fmt: skip


def test_the_cli_counts_the_window_on_the_ranks_that_hold_it(capsys):
    """A window of 1024 at 8192 tokens tiles (T 1024, 2047 keys): on pp2's rank 0, the worst
    (two pairs held, 16-bit activations), the band bias and mask once and each of its four
    layers' second output per pair. The same window on the first half of the layers only
    (rank 0's) adds as much; on the second half only (rank 1's, one pair) the worst rank is
    still rank 0, as without a window."""
    from megart.plan.hardware import GIB

    def activations(extra: str) -> float:
        return plan_json(BIG + extra, capsys)["memory_gib"]["activations"] * GIB

    plain = activations("")
    tiled = activations(" --window-size 1023,0")
    once = 1024 * 2048 * 2 + 1024 * 2047
    assert tiled - plain == pytest.approx(once + 2 * 4 * 8192 * 1024 * 2)
    assert activations(" --window-size 1023,0 --window-attn-skip-freq ([1]*4+[0]*4)") == tiled
    assert activations(" --window-size 1023,0 --window-attn-skip-freq ([0]*4+[1]*4)") == plain
