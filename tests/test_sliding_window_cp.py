"""Sliding-window attention under context parallelism's exchanges other than the all-gather
(tests/test_sliding_window.py has that one): the all-to-all (--cp-comm-type a2a), whose ranks
attend with some heads over the whole sequence in order, so that the window applies as in one
process, and the ring (p2p), whose blocks are masked by global positions (the masked kernels'
pieces, or explicit products) and skipped where wholly outside the window. The exchanges'
attention equals one process's in float64 at cp2 to cp4 (several tiles a block too); float64
attention and whole models at cp2 and cp4 equal one process's for windows shorter than a
rank's chunk up to windows covering the sequence, with windowed and full layers mixed; megart
train's command line with --window-size under either follows the one-process curve."""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cp_workers as cw
import megatron_workers as mw
import ring_workers as rw
from megart.launcher import launch

S, LAYERS = 16, 3
# 8 heads in 4 query groups: at cp4 each rank attends with 2 heads of one group.
A2A = dict(vocab_size=300, seq_length=S, hidden_size=32, num_layers=LAYERS, num_attention_heads=8,
           num_query_groups=4, init_std=0.5, cp_comm_type="a2a")  # fmt: skip
LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=64, bias=False, untie_embeddings_and_output_weights=True)  # fmt: skip

windows = st.integers(0, S + 2)  # S / 4 = 4 tokens a cp4 rank, 2 a chunk; S - 1 covers all
patterns = st.one_of(
    st.none(), st.integers(1, LAYERS), st.tuples(*[st.sampled_from([0, 1])] * LAYERS)
)


# -- the exchanges' attention -----------------------------------------------------------------


@settings(max_examples=4, deadline=None)
@given(
    cp=st.integers(2, 4),
    half=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    left=st.integers(0, 30),
    tile=st.sampled_from([None, 7]),
)
@example(cp=4, half=2, groups=2, left=1, tile=7)  # shorter than a chunk
@example(cp=2, half=3, groups=1, left=11, tile=None)  # covers the 12-token sequence
def test_the_exchanges_attention_with_a_window_is_one_process_in_float64(
    cp, half, groups, left, tile
):
    """The ring's blocks ("auto": the masked kernels' pieces, tests/test_ring_window_blocks.py;
    or explicit in tiles of 7 scores, so that a block's mask spans tiles) and the all-to-all:
    output and q, k, v gradients against a float64 reference written from the definition."""
    base = dict(seed=left, b=2, heads=4, groups=groups, half=half, d=3, window=left)
    ring = dict(base) if tile is None else dict(base, tile=tile)
    cases = [ring, dict(base, heads=2 * cp, groups=cp, kind="a2a")]  # heads, groups split
    assert max(launch(rw.against_reference, cp, cases, timeout=120)) < 1e-12


@pytest.mark.parametrize("window, want", [(0, [2, 2, 2, 2]), (2, [4, 6, 6, 4]),
                                          (None, [8, 8, 8, 8])])  # fmt: skip
def test_the_ring_scores_only_the_blocks_inside_the_window(window, want):
    """cp4, 8 chunks of 2 tokens, rank r holding chunks r and 7 - r: the tiles scored by a
    rank's forward and backward (one tile a block). A window of 0: its own block only (1 of 4
    steps, twice). Of 2: also rank r - 1's block (its first chunk ends 1 token before chunk
    r) and rank r + 1's (its second chunk, 6 - r, ends 1 token before chunk 7 - r); ranks 0
    and 3 have one of those. None: every step."""
    case = dict(seed=1, b=1, heads=2, groups=1, half=2, d=3)
    assert launch(rw.scored_steps, 4, case, window, timeout=120) == want


@pytest.mark.parametrize("cp", [2, 4])
def test_the_rings_dropout_with_a_window_is_its_own_derivative(cp):
    """Attention dropout 0.3 with a window of 2 (the explicit blocks, some skipped): output and
    gradients equal one process's float64 attention under the same window given the kept
    entries the ring drew (ring_workers.dropout_masks, no draw for a skipped block), so the
    backward replays the forward's masks."""
    case = dict(seed=3, b=1, heads=4, groups=2, half=2, d=3)
    assert max(launch(rw.against_reference_with_dropout, cp, case, 0.3, 2, timeout=120)) < 1e-12


# -- layers and models -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["a2a", "p2p"])
@settings(max_examples=3, deadline=None)
@given(left=windows, skip=patterns)
@example(left=1, skip=(1, 0, 1))  # shorter than a chunk, a full layer between windowed ones
@example(left=S - 1, skip=None)  # covers the whole sequence: no window
@example(left=5, skip=2)  # crosses chunks and ranks; every second layer full
def test_cp2_and_cp4_are_the_one_process_model_in_float64(kind, left, skip):
    """cw.against_one_process: one windowed layer's attention (rope, GQA: output, input and
    weight gradients) and a Llama-style model with ``skip``'s layer pattern (loss, gradients)."""
    attention = dict(A2A, position_embedding="rotary", window_size=(left, 0), cp_comm_type=kind)
    model = dict(attention, **LLAMA, window_attn_skip_freq=skip)
    per_rank = launch(cw.against_one_process, 4, attention, [model], timeout=180)
    worst = {k: max(r[k] for r in per_rank if k in r) for k in per_rank[0] | per_rank[-1]}
    assert len(worst) == 2 * (2 + 4 + 2), worst  # y, dx, 4 weights; loss, grads; at cp2, cp4
    assert max(worst.values()) < 1e-12, worst


@pytest.mark.parametrize("kind", ["a2a", "p2p"])
def test_tp2_x_cp2_with_sequence_parallelism_is_the_one_process_model_in_float64(kind):
    """cw.tp_sp_against_one_process: the Llama-style model, windows of 1 and 5 tokens on two of
    its three layers, each cp rank's s/cp tokens split over t outside attention and the MLP
    (a2a: 4 heads in 2 groups a tensor-parallel rank, split over cp); loss and every
    gradient."""
    model = dict(A2A, **LLAMA, window_size=(1, 0), window_attn_skip_freq=3, cp_comm_type=kind)
    models = [model, dict(model, window_size=(5, 0), window_attn_skip_freq=(0, 1, 1))]
    per_rank = launch(cw.tp_sp_against_one_process, 4, models, timeout=120)
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    assert len(worst) == 2 * (1 + 24), worst  # a loss and 24 gradients a model
    assert max(worst.values()) < 1e-12, worst


# -- megart train ----------------------------------------------------------------------------

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-warmup-iters", "1", "--eval-iters", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--init-method-std", "0.2",
         "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--window-size", "3,0",
         "--window-attn-skip-freq", "[1,1,0,1]"]  # fmt: skip


def cli_losses(nproc: int, argv: list[str], log) -> list[float]:
    """megart train ``argv`` on ``nproc`` ranks: the losses its --log-jsonl recorded."""
    status, out = launch(mw.run_cli, nproc, [*argv, "--log-jsonl", str(log)], timeout=400)[0]
    assert status == 0, out
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_megart_train_with_a_window_follows_the_one_process_curve_under_a2a_and_p2p(tmp_path):
    straight = cli_losses(1, FLAGS, tmp_path / "one.jsonl")
    unwindowed = cli_losses(1, FLAGS[:-4], tmp_path / "plain.jsonl")
    assert abs(unwindowed[-1] - straight[-1]) > 1e-3 * abs(straight[-1])  # the window shows
    # Selective recomputation runs the ring's windowed forward again inside the backward.
    selective = ["--recompute-granularity", "selective"]
    for kind, more in (("a2a", []), ("p2p", []), ("p2p", selective)):
        layout = ["--context-parallel-size", "2", "--cp-comm-type", kind, *more]
        got = cli_losses(2, [*FLAGS, *layout], tmp_path / f"{kind}{len(more)}.jsonl")
        assert got == pytest.approx(straight, rel=5e-6, abs=0) and len(got) == 3, layout
