"""megart plan with sliding windows (--window-size, --window-attn-skip-freq): a windowed layer's
attention products are the entries megart's runtime scores (counted from the SDPA calls of a
real GPT forward, skipped layers causal as flash), under one process and a2a; all_gather's
explicit mask scores all of a rank's (s/cp) x s; pipeline ranks whose layers differ in windows
are planned as uneven stages; model FLOPs (tflops_per_gpu) ignore the window, as
Megatron-LM's num_floating_point_operations does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megart.models import GPT, GPTConfig
from megart.models import window_tiles as wt
from megart.models.window_masks import bias_row_stride
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout
from megart.plan.timing import (
    CAUSAL_SHARE,
    FLASH_BACKWARD,
    gemm_seconds,
    layer_work,
    window_bias_reads,
    window_share,
)
from megart.training.config import TrainConfig

GPU = load_profile("h100-80gb")


@pytest.mark.parametrize(
    ("s", "left", "skip"), [(64, 3, (1, 0, 1)), (61, 5, None), (48, 20, 2), (40, 0, (0, 1, 1))]
)
def test_the_plans_entries_are_the_runtimes_sdpa_calls(monkeypatch, s, left, skip):
    """Every SDPA call of a GPT forward (small tiles, so that a short sequence tiles): the
    windowed layers' query x key entries are window_share's, the others' one causal call."""
    monkeypatch.setattr(wt, "TILE_FLOOR", 4)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(q, k, *args, is_causal=False, **kwargs):
        mask = args[1] if len(args) > 1 else kwargs.get("attn_mask")
        reads = 0 if mask is None else mask.shape[-2] * bias_row_stride(mask.shape[-1])
        calls.append((q.shape[2] * k.shape[2], is_causal, reads))
        return sdpa(q, k, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    cfg = GPTConfig(vocab_size=32, seq_length=s, hidden_size=16, num_layers=3,
                    num_attention_heads=2, window_size=(left, 0),
                    window_attn_skip_freq=skip)  # fmt: skip
    with torch.no_grad():
        GPT(cfg)(torch.zeros(1, s, dtype=torch.long))
    windowed = sum(
        1
        for i in range(3)
        if (skip is None or (skip[i] if isinstance(skip, tuple) else (i + 1) % skip))
    )
    masked = sum(n for n, causal, _ in calls if not causal)
    assert masked == round(windowed * window_share(s, left, True) * s * s)
    assert [n for n, causal, _ in calls if causal] == [s * s] * (3 - windowed)
    # The bias slices the masked calls take, as the plan reads them once a pass.
    assert sum(r for *_, r in calls) == windowed * window_bias_reads(s, left, True)
    if left == 20:  # 2 (24 + 20) > 48: one s x s mask, every entry
        assert window_share(s, left, True) == 1.0


def _layer(window, cp=1, comm="a2a", unfused=False, s=32768):
    cfg = GPTConfig(vocab_size=32000, seq_length=s, hidden_size=4096, num_layers=2,
                    num_attention_heads=32, cp_comm_type=comm)  # fmt: skip
    return layer_work(cfg, 1, 1, False, None, GPU, unfused, cp=cp, window=window), cfg


@pytest.mark.parametrize(("cp", "comm"), [(1, "a2a"), (2, "a2a"), (2, "all_gather")])
def test_a_windowed_layers_core_is_its_share_of_the_products(cp, comm):
    left, s = 4095, 32768
    full, cfg = _layer(None, cp, comm)
    windowed, _ = _layer(left, cp, comm)
    d, heads = cfg.head_dim, cfg.num_attention_heads
    rows = s if comm == "a2a" else s // cp
    heads = heads / cp if comm == "a2a" else heads
    core = gemm_seconds(rows, s, d, GPU, heads) + gemm_seconds(rows, d, s, GPU, heads)
    # The tiles' entries, enumerated here: T = 4096, keys (a - 4095 .. a + 4096).
    tiles = [(a, min(4096, s - a), max(0, a - left)) for a in range(0, s, 4096)]
    share = sum(n * (a + n - k) for a, n, k in tiles) / s**2 if comm == "a2a" else 1.0
    assert share == window_share(s, left, comm == "a2a")
    # Each pass reads the bias slices once: the tiles' [n, keys] (rows 16-aligned), or the
    # rank's [s/cp, s] under all_gather; 16-bit.
    aligned = [n * -(-(a + n - k) // 16) * 16 for a, n, k in tiles]
    read = (sum(aligned) if comm == "a2a" else s // cp * s) * 2 / (GPU.hbm_gb_per_s * 1e9)
    assert windowed.forward - full.forward == pytest.approx(core * (share - CAUSAL_SHARE) + read)
    assert windowed.backward - full.backward == pytest.approx(
        FLASH_BACKWARD * core * (share - CAUSAL_SHARE) + read
    )
    if comm == "a2a":  # (2 T + ... ) / s: under the causal half's 0.5 at s = 8 T
        assert share < CAUSAL_SHARE
    # A window covering the sequence is no window; the ring's windowed layers compute their
    # pieces inside the window (plan.ring_window_cost: tests/test_plan_ring_window.py).
    assert _layer(s - 1, cp, comm)[0] == full
    assert _layer(left, 2, "p2p")[0].forward < _layer(None, 2, "p2p")[0].forward


def test_unfused_scores_are_the_tiles_entries():
    """--attention-backend unfused (torch's math kernel, scores kept): the products and the
    softmax/dropout bytes of the scores both shrink from all s x s to the tiles' share."""
    s, left = 32768, 4095
    full, cfg = _layer(None, unfused=True)
    windowed, _ = _layer(left, unfused=True)
    d, heads = cfg.head_dim, cfg.num_attention_heads
    share = window_share(s, left, True)
    core = gemm_seconds(s, s, d, GPU, heads) + gemm_seconds(s, d, s, GPU, heads)
    score_bytes = s * 4.5 * heads * s * 2 / (GPU.hbm_gb_per_s * 1e9)  # 16-bit, per token
    shrink = (core + score_bytes) * (1 - share)
    read = window_bias_reads(s, left, True) * 2 / (GPU.hbm_gb_per_s * 1e9)  # once a pass
    assert full.forward - windowed.forward == pytest.approx(shrink - read)
    assert full.backward - windowed.backward == pytest.approx(
        2 * core * (1 - share) + 2 * score_bytes * (1 - share) - read
    )


BASE = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=8192,
            vocab_size=32000, global_batch_size=8, micro_batch_size=1, train_iters=1)  # fmt: skip


def _estimate(**kw):
    layout = Layout(1, 2, 1, 1, 1, False, None, False)
    return estimate(TrainConfig(**BASE, **kw), layout, GPU, simulate=False)


def test_zb_v_ranks_hold_their_v_shaped_layers_and_the_output_layer_on_rank_0():
    """zb-v places chunk 0 down the ranks and chunk 1 back up (models.gpt.chunk_layers): at
    4 layers on pp2 rank 0 holds layers 1 and 4 (and the output layer), rank 1 layers 2 and 3;
    windowing layers 1 and 4 makes rank 0 the cheaper one, the output layer counted on it."""
    from megart.plan.timing import logits_work

    layout = Layout(1, 2, 1, 2, 1, False, None, False, "zb-v")
    config = TrainConfig(**BASE, window_size="255,0", window_attn_skip_freq="[1,0,0,1]")
    v = estimate(config, layout, GPU, simulate=False)
    cfg = config.gpt_config()
    windowed = layer_work(cfg, 1, 1, False, None, GPU, window=255)
    full = layer_work(cfg, 1, 1, False, None, GPU)
    logits = logits_work(cfg, 1, 1, GPU)
    assert v.stages[0].forward == pytest.approx(2 * windowed.forward + logits.forward)
    assert v.stages[1].forward == pytest.approx(2 * full.forward)


def test_pipeline_ranks_with_other_windows_are_uneven_stages():
    plain = _estimate()
    assert plain.stages == []
    every = _estimate(window_size="255,0")
    assert every.stages == [] and every.stage.forward < plain.stage.forward
    # Layers 1-2 windowed on rank 0, 3-4 full on rank 1 (with the output layer).
    mixed = _estimate(window_size="255,0", window_attn_skip_freq="[1,1,0,0]")
    cfg = GPTConfig(vocab_size=32000, seq_length=8192, hidden_size=1024, num_layers=4,
                    num_attention_heads=16)  # fmt: skip
    one = layer_work(cfg, 1, 1, False, None, GPU, window=255)
    assert mixed.stages[0].forward == pytest.approx(2 * one.forward)
    assert mixed.stages[1] == plain.stage
    assert mixed.stage == plain.stage  # the slowest: rank 1's full layers and logits
    # Model FLOPs ignore the window (Megatron's count): the same FLOPs over each run's time.
    for e in (every, mixed):
        assert e.tflops_per_gpu * e.time["iteration"] == pytest.approx(
            plain.tflops_per_gpu * plain.time["iteration"]
        )
