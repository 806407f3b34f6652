"""megart plan's cost rules that carry its fitted constants and its rails: a matrix product's
efficiency follows its smallest dimension, flash attention's core runs the causal half and
recomputes its scores, and a data-parallel group drives one rail per GPU it has in a node."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megart.errors import ConfigError
from megart.models.config import GPTConfig
from megart.plan import load_profile
from megart.plan.data_parallel import data_parallel_bus_gb_per_s
from megart.plan.hardware import PROFILE_DIR
from megart.plan.timing import gemm_seconds, layer_work

A100 = load_profile("a100-80gb")
H100 = load_profile("h100-80gb")


@pytest.mark.parametrize(
    "tp,dp,rails",
    [
        (8, 32, 1),  # Table 1's t = 8: one member of the group per node
        (4, 32, 2),
        (2, 32, 4),
        (1, 64, 8),  # a whole node in the group
        (16, 4, 1),  # a tensor-parallel group wider than a node
    ],
)
def test_a_data_parallel_group_drives_one_rail_per_gpu_it_has_in_a_node(tp, dp, rails):
    assert data_parallel_bus_gb_per_s(A100, tp, dp) == pytest.approx(rails * A100.rail_gb_per_s)


@pytest.mark.parametrize("tp,dp", [(1, 8), (2, 4), (4, 2), (1, 2)])
def test_a_data_parallel_group_inside_one_node_uses_nvlink(tp, dp):
    assert data_parallel_bus_gb_per_s(A100, tp, dp) == A100.nvlink_bus_gb_per_s


def test_rails_never_beat_the_nvlink_they_feed():
    # An H100 node's eight NDR rails (8 x 47.5 GB/s) carry more than its NVLink busbw: the
    # group's traffic also crosses NVLink inside each node, so NVLink bounds it.
    assert 8 * H100.rail_gb_per_s > H100.nvlink_bus_gb_per_s
    assert data_parallel_bus_gb_per_s(H100, 1, 64) == H100.nvlink_bus_gb_per_s


def test_a_product_runs_at_the_efficiency_of_its_smallest_dimension():
    # gemm_half_dim is where a product reaches half the large-product efficiency, whichever of
    # its three dimensions is the small one.
    gpu = dataclasses.replace(A100, gemm_half_dim=64)
    flops = 2 * 4096 * 4096 * 64
    rate = gpu.peak_tflops * 1e12 * gpu.gemm_efficiency_max
    for shape in ((4096, 4096, 64), (4096, 64, 4096), (64, 4096, 4096)):
        assert gemm_seconds(*shape, gpu) == pytest.approx(flops / (rate / 2))
    # The same FLOPs with no thin side: nearer e_max.
    square = gemm_seconds(1024, 1024, 1024, gpu)
    assert square == pytest.approx(flops / (rate * 1024 / (1024 + 64)))
    assert gemm_seconds(64, 64, 64, gpu, count=4096) == pytest.approx(flops / (rate / 2))


def test_more_heads_of_the_same_width_make_a_slower_attention_core():
    # Same h and FLOPs, head size 128 against 64: the scores' products get thinner. A FLOPs-only
    # efficiency would time the two alike.
    def core(heads: int) -> float:
        cfg = GPTConfig(
            num_layers=1,
            hidden_size=4096,
            num_attention_heads=heads,
            seq_length=2048,
            vocab_size=51200,
        )
        return layer_work(cfg, 1, 1, False, None, A100).forward

    assert core(64) > core(32)


def test_flash_attention_runs_half_the_causal_products_and_recomputes_its_scores():
    # Measured on an H200 (bench/layer_profile.py): cuDNN's flash backward takes 3.2-3.4 times
    # its forward, the products beside it 2.0-2.2 times theirs. One layer on one GPU (no
    # collectives), so backward - 2 x forward is what the core's backward adds beyond two.
    cfg = GPTConfig(
        num_layers=1, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=256
    )
    s, d, heads = cfg.seq_length, cfg.head_dim, 4 * cfg.num_attention_heads  # micro batch 4
    full_core = gemm_seconds(s, s, d, H100, heads) + gemm_seconds(s, d, s, H100, heads)
    flash = layer_work(cfg, 4, 1, False, None, H100)
    # Half the score blocks (causal), and 5 products per forward 2 on them: 0.5 more than 2.
    assert flash.backward - 2 * flash.forward == pytest.approx(0.5 * (0.5 * full_core))
    kept = layer_work(cfg, 4, 1, False, None, H100, unfused_attention=True)
    assert kept.backward == pytest.approx(2 * kept.forward)  # the scores are stored
    assert kept.forward > flash.forward + 0.5 * full_core  # every block, and the scores' bytes


def test_a_profile_with_the_old_flops_constant_is_told_what_replaced_it(tmp_path):
    old = json.loads((PROFILE_DIR / "a100-80gb.json").read_text())
    old["gemm_half_gflop"] = old.pop("gemm_half_dim") // 8
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="gemm_half_gflop was replaced by gemm_half_dim"):
        load_profile(path=str(path))


def test_the_fused_loss_moves_the_16_bit_logits_once_each_way():
    """--cross-entropy-loss-fusion's kernels read the 16-bit logits once forward and read and
    overwrite them with their gradient backward (megart.kernels.cross_entropy); the unfused
    loss writes and reads fp32 logits each way. The output layer's products are the same."""
    from megart.plan.timing import logits_work

    gpu = load_profile("h100-80gb")
    model = dict(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=2048,
                 vocab_size=50257)  # fmt: skip
    b, tp = 2, 2
    unfused = logits_work(GPTConfig(**model), b, tp, gpu)
    fused = logits_work(GPTConfig(**model, cross_entropy_loss_fusion=True), b, tp, gpu)
    logits = 2048 * b * GPTConfig(**model).padded_vocab_size(tp) // tp  # elements on a rank
    hbm = gpu.hbm_gb_per_s * 1e9
    assert unfused.forward - fused.forward == pytest.approx(logits * (8 - 2) / hbm, rel=1e-12)
    assert unfused.backward - fused.backward == pytest.approx(logits * (8 - 4) / hbm, rel=1e-12)
    assert fused.weight == unfused.weight


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(num_query_groups=2, activation="swiglu", bias=False),
        dict(kv_channels=32, num_query_groups=2),  # q = 4 x 32 = 128 on h 64
        dict(kv_channels=8, activation="swiglu"),  # q = 32
    ],
    ids=["gpt", "llama-gqa", "wide-heads", "narrow-heads"],
)
def test_the_products_timed_are_the_ones_a_layer_runs(kw):
    """The plan's dense products (q/k/v, output projection, MLP) against those one megart
    layer's forward runs, counted by torch's flop counter: at a constant efficiency (no
    half-dimension) their time is their FLOPs over the product rate."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megart.models.blocks import Block

    cfg = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16,
                    vocab_size=256, **kw)  # fmt: skip
    b = 3
    with FlopCounterMode(display=False) as counter:
        Block(cfg, 0, None, False)(torch.randn(cfg.seq_length, b, 64), None)
    counts = counter.get_flop_counts()["Global"]
    dense = sum(n for op, n in counts.items() if str(op).split(".")[1] in ("mm", "addmm"))
    gpu = dataclasses.replace(A100, gemm_half_dim=0)
    rate = gpu.peak_tflops * 1e12 * gpu.gemm_efficiency_max
    assert layer_work(cfg, b, 1, False, None, gpu).weight * rate == pytest.approx(dense)
