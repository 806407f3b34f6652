"""The ring (--cp-comm-type p2p) under a sliding window with fused blocks: each step's block cut
into the pieces inside the window (megart.models.ring_window), each piece by the masked kernels
(megart.models.flash_blocks.masked_forward/backward: the CPU's flash kernel given the piece's
bias here, CUDA's memory-efficient kernel on a GPU). The pieces are exactly the block's allowed
(query, key) pairs, every row of a piece sees a key and every key is seen, and each piece's
cached bias is the window's mask at its global positions. Over real ranks (cp2, cp4) the ring
equals one process's attention in float64 (output, q/k/v gradients; windows shorter than a
chunk, a chunk, a rank's tokens, longer; GQA, MQA, MHA); fp32 and bf16 inputs are within their
rounding of float64. (That the CPU kernel is what runs, and that dropout on the CPU keeps the
explicit blocks, is tests/test_context_parallel_ring.py's.)"""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cp_workers as cw
import ring_workers as rw
from megart.launcher import launch
from megart.models import ring_window
from megart.models.context_parallel import cp_positions
from megart.models.ring_attention import BlockWindow, _Ring, block_of
from megart.models.window_masks import ALIGN, window_mask
from megart.selftest import ring_window_blocks

F64_ABS = 1e-12
BF16_REL = 2e-2  # the GPU ring test's bound for bf16 against float64
FP32_REL = 1e-5
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA's kernels)")


class _FakeRing(_Ring):
    def __init__(self, cp: int, rank: int) -> None:  # BlockWindow reads cp and rank only
        self.cp, self.rank = cp, rank


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(2, 4), half=st.integers(1, 6), window=st.integers(0, 50))
@example(cp=4, half=3, window=1)  # shorter than a chunk
@example(cp=2, half=4, window=4)  # a chunk
@example(cp=2, half=600, window=40)  # query runs in tiles of 257 rows (band_tile)
@example(cp=3, half=700, window=0)
def test_the_pieces_are_the_blocks_allowed_pairs_each_row_and_key_seen(cp, half, window):
    """For every rank and step: the pieces' pairs allowed by their masks are the block's allowed
    pairs (global positions: causal, at most ``window`` back), each once; every row of a piece
    has a key in its window and every key of a piece is in some row's; a piece is ``full``
    or ``causal`` exactly when its mask is, and otherwise its bias is 0 / -inf by that mask,
    rows ALIGN-strided; a block without pieces is one the explicit blocks skip."""
    local = 2 * half
    for rank in range(cp):
        queries = cp_positions(local * cp, cp, rank, None)
        for step in range(cp):
            held = cp_positions(local * cp, cp, (rank - step) % cp, None)
            rows, keys, _ = block_of(step, cp, rank, local)
            covered = torch.zeros(local, local, dtype=torch.int64)
            parts = ring_window.pieces(step, cp, rank, local, rows, keys, window)
            for p in parts:
                mask = window_mask(queries[p.rows], held[p.keys], window)
                assert mask.any(1).all() and mask.any(0).all(), (rank, step, p)
                covered[p.rows, p.keys] += mask
                assert p.full == bool(mask.all())
                assert p.causal == (not p.full and torch.equal(mask, torch.ones_like(mask).tril()))
                bias = p.bias(window, torch.float64, torch.device("cpu"))
                if bias is None:
                    continue
                assert bias.stride(0) % ALIGN == 0
                assert torch.equal(bias == 0, mask) and bool((bias[~mask] == -torch.inf).all())
            want = torch.zeros(local, local, dtype=torch.int64)
            want[rows, keys] = window_mask(queries[rows], held[keys], window).long()
            assert torch.equal(covered, want), (rank, step)
            bw = BlockWindow(step, _FakeRing(cp, rank), local, rows, keys, window)
            assert bool(parts) == bw.reaches


@pytest.mark.parametrize("cp", [2, 4])
def test_the_windowed_ring_with_masked_kernels_is_one_process_attention_in_float64(cp):
    """Chunks of 3 tokens (6 a rank): windows of 0, 1 (shorter than a chunk), 3 (a chunk), 6 (a
    rank's tokens), 8 and 100 (covering the sequence); GQA (4 heads, 2 groups), MQA, MHA; and
    chunks of 600 with a window of 40, whose query runs are cut in tiles (band_tile)."""
    base = dict(b=2, heads=4, groups=2, half=3, d=5, blocks="flash")
    cases = [dict(base, seed=w, window=w) for w in (0, 1, 3, 6, 8, 100)]
    cases += [dict(base, seed=7, heads=3, groups=1, window=2),
              dict(base, seed=8, heads=2, groups=2, half=2, window=5),
              dict(base, seed=9, b=1, heads=2, groups=1, half=600, d=4, window=40)]  # fmt: skip
    assert max(launch(rw.against_reference, cp, cases, timeout=120)) < F64_ABS


@pytest.mark.parametrize("cp", [2, 4])
def test_in_fp32_and_bf16_the_windowed_ring_is_float64_within_rounding(cp):
    """Inputs in fp32 and bf16 (the bias in their dtype): output and gradients against the
    float64 reference, largest error over largest value."""
    base = dict(b=1, heads=4, groups=2, half=8, d=16, blocks="flash")
    windows = (3, 8, 16, 40)  # shorter than a chunk, a chunk, a rank's tokens, longer
    fp32 = [dict(base, seed=w, window=w, dtype=torch.float32) for w in windows]
    bf16 = [dict(c, dtype=torch.bfloat16) for c in fp32]
    assert max(launch(rw.relative_on_cpu, cp, fp32, timeout=120)) < FP32_REL
    assert max(launch(rw.relative_on_cpu, cp, bf16, timeout=120)) < BF16_REL


def test_megart_train_in_bf16_with_a_window_at_cp2_follows_the_one_process_bf16_curve():
    """--bf16 (autocast), a window of 3 on every other layer, GQA, rope: the ring's windowed
    blocks by the CPU kernel in bf16 (the explicit ones were fp32), within the bound
    tests/test_context_parallel_ring.py uses for the ring's bf16 curve."""
    kw = dict(vocab_size=300, train_iters=4, position_embedding_type="rope",
              init_method_std=0.2, normalization="RMSNorm", swiglu=True,
              group_query_attention=True, num_query_groups=2, bf16=True,
              window_size="3,0", window_attn_skip_freq="2")  # fmt: skip
    want = launch(cw.losses, 1, kw, timeout=300)[0]
    got = launch(cw.losses, 2, dict(kw, context_parallel_size=2), timeout=300)[0]
    assert got == pytest.approx(want, rel=2e-3, abs=0)


def test_the_selftest_check_passes_here_and_fails_a_shifted_window(monkeypatch):
    """megart selftest's check on this CPU passes; with each piece's bias built one position
    off (the window shifted by one) it fails, naming the flag that avoids the ring."""
    cpu = torch.device("cpu")
    (good,) = ring_window_blocks.check_ring_window_blocks(cpu)
    assert good.status == "pass" and good.error < 1e-5, good
    real = ring_window.piece_bias.__wrapped__

    def shifted(rows, keys, delta, window, dtype, device):
        return real(rows, keys, delta + 1, window, dtype, device)

    monkeypatch.setattr(ring_window, "piece_bias", shifted)
    (bad,) = ring_window_blocks.check_ring_window_blocks(cpu)
    assert bad.status == "fail" and "--cp-comm-type all_gather" in bad.detail, bad


@GPU
@pytest.mark.gpu_ranks
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, BF16_REL), (torch.float32, 1e-4)])
def test_on_a_gpu_the_windowed_ring_is_one_process_attention_in_float64(cp, dtype, bound):
    """CUDA's memory-efficient kernel given the pieces' biases (GQA: 4 heads in 2 groups of 64),
    ranks sharing GPU 0 over megart's nccl transport, windows shorter than a chunk (64 tokens)
    and longer than a rank's tokens: within the dtype's error of float64."""
    for window in (40, 300):
        case = dict(seed=6, b=2, heads=4, groups=2, half=64, d=64, window=window, dtype=dtype)
        assert max(launch(rw.against_reference_on_gpu_0, cp, case, timeout=300)) < bound
