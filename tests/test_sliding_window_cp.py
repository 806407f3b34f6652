"""Sliding-window attention under context parallelism's exchanges other than the all-gather
(tests/test_sliding_window.py has that one): the all-to-all (--cp-comm-type a2a), whose ranks
attend with some heads over the whole sequence in order, so that the window applies as in one
process. float64 attention and whole models at cp2 and cp4 equal one process's for windows
shorter than a rank's chunk up to windows covering the sequence, with windowed and full layers
mixed; megart train's command line with --cp-comm-type a2a --window-size follows the
one-process curve."""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cp_workers as cw
import megatron_workers as mw
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


@settings(max_examples=3, deadline=None)
@given(left=windows, skip=patterns)
@example(left=1, skip=(1, 0, 1))  # shorter than a chunk, a full layer between windowed ones
@example(left=S - 1, skip=None)  # covers the whole sequence: no window
@example(left=5, skip=2)  # crosses chunks and ranks; every second layer full
def test_a2a_at_cp2_and_cp4_is_the_one_process_model_in_float64(left, skip):
    """cw.against_one_process: one windowed layer's attention (rope, GQA: output, input and
    weight gradients) and a Llama-style model with ``skip``'s layer pattern (loss, gradients)."""
    attention = dict(A2A, position_embedding="rotary", window_size=(left, 0))
    model = dict(A2A, **LLAMA, window_size=(left, 0), window_attn_skip_freq=skip)
    per_rank = launch(cw.against_one_process, 4, attention, [model], timeout=180)
    worst = {k: max(r[k] for r in per_rank if k in r) for k in per_rank[0] | per_rank[-1]}
    assert len(worst) == 2 * (2 + 4 + 2), worst  # y, dx, 4 weights; loss, grads; at cp2, cp4
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


def test_megart_train_a2a_with_a_window_follows_the_one_process_curve(tmp_path):
    straight = cli_losses(1, FLAGS, tmp_path / "one.jsonl")
    unwindowed = cli_losses(1, FLAGS[:-4], tmp_path / "plain.jsonl")
    assert abs(unwindowed[-1] - straight[-1]) > 1e-3 * abs(straight[-1])  # the window shows
    a2a = ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]
    got = cli_losses(2, [*FLAGS, *a2a], tmp_path / "a2a.jsonl")
    assert got == pytest.approx(straight, rel=5e-6, abs=0) and len(got) == 3
