"""The layers full recomputation replays, in megart train's FLOPs (TFLOP/s) and posting-plan
costs: every layer under --recompute-method uniform, the first --recompute-num-layers of each
model chunk under block, summed over every chunk of every pipeline rank (interleaved, zb-v and
uneven stages included). Checked against the chunk sizes written out by hand, against the
layers whose forward really runs twice in the chunks megart train builds, against torch's FLOP
counter, and against what a real two-rank CPU run of megart train logs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import megatron_workers as mw
from megart import ConfigError
from megart.launcher import launch
from megart.models import pipeline_chunks
from megart.training.config import TrainConfig
from megart.training.layer_placement import placement, replayed_layer_count
from megart.training.pipeline_costs import plan_costs
from megart.training.trainer_setup import flop_counts

MODEL = dict(hidden_size=16, num_attention_heads=2, seq_length=8, micro_batch_size=1)

# Layouts, each with the layers of every model chunk of every rank written out by hand.
LAYOUTS = {
    "pp1": (dict(num_layers=4), [4]),
    "pp2": (dict(num_layers=8, pipeline_model_parallel_size=2), [4, 4]),
    # v = 2: each rank two chunks of 8 / (2 x 2) layers.
    "pp2-v2": (
        dict(num_layers=8, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2),
        [2, 2, 2, 2],
    ),
    "pp2-zbv": (
        dict(num_layers=8, pipeline_model_parallel_size=2, pipeline_schedule="zb-v"),
        [2, 2, 2, 2],
    ),
    # Rank 0 holds 2 layers, rank 1 the other 6.
    "pp2-first2": (
        dict(num_layers=8, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2),
        [2, 6],
    ),
    # 1, 3, 1 layers.
    "pp3-first1-last1": (
        dict(
            num_layers=5,
            pipeline_model_parallel_size=3,
            decoder_first_pipeline_num_layers=1,
            decoder_last_pipeline_num_layers=1,
        ),
        [1, 3, 1],
    ),
    # Rank 0 holds 2 layers in two chunks of 1, rank 1 six in two chunks of 3.
    "pp2-v2-first2": (
        dict(
            num_layers=8,
            pipeline_model_parallel_size=2,
            num_virtual_stages_per_pipeline_rank=2,
            decoder_first_pipeline_num_layers=2,
        ),
        [1, 1, 3, 3],
    ),
}
RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "uniform1": dict(recompute_granularity="full"),
    "uniform3": dict(recompute_granularity="full", recompute_num_layers=3),
    "block1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "block2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "block-all": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=8
    ),
    "block-past-chunk": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=99
    ),
}


def by_definition(sizes: list[int], recompute: dict) -> int:
    """The replayed layers of chunks of ``sizes`` layers, by the flags' definition."""
    if recompute.get("recompute_granularity") != "full":
        return 0
    if recompute.get("recompute_method", "uniform") == "uniform":
        return sum(sizes)  # every layer, whatever the grouping
    n = recompute["recompute_num_layers"]
    return sum(min(n, size) for size in sizes)  # the first n of each chunk


def config(layout: dict, recompute: dict, global_batch_size: int = 4) -> TrainConfig:
    return TrainConfig(**MODEL, **layout, **recompute, global_batch_size=global_batch_size)


def layer_forward_flops(c: TrainConfig, causal: bool = True) -> int:
    """One layer's forward over the global batch (multi-head attention, a GeLU MLP of 4h),
    written out: Q, K, V and the output projection 8 B s h^2, the MLP 16 B s h^2, the scores and
    scores x values 2 B s^2 h each over the whole s x s matrix, half of that causal."""
    b, s, h = c.global_batch_size, c.seq_length, c.hidden_size
    return 24 * b * s * h * h + (2 if causal else 4) * b * s * s * h


def run_chunks(c: TrainConfig) -> tuple[int, int]:
    """Forward and backward through the layers of every chunk of every rank, built as megart
    train builds them: (how many layer forwards ran beyond one per layer, the FLOPs torch
    counted)."""
    cfg = c.gpt_config()
    calls = 0

    def count(*_: object) -> None:
        nonlocal calls
        calls += 1

    flops = 0
    for rank in range(c.pp):
        torch.manual_seed(rank)
        for chunk in pipeline_chunks(cfg, rank, **placement(c)):
            for block in chunk.blocks:
                block.register_forward_pre_hook(count)  # replays may stop early
            x = torch.randn(c.seq_length, c.micro_batch_size, c.hidden_size, requires_grad=True)
            with FlopCounterMode(display=False) as counter:  # each entry starts from 0
                chunk._blocks(x, None).sum().backward()
            flops += counter.get_total_flops()
    return calls - c.num_layers, flops


@pytest.mark.parametrize("recompute", RECOMPUTE.values(), ids=RECOMPUTE.keys())
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_replayed_layers_are_those_that_run_twice(layout, recompute):
    kw, sizes = layout
    c = config(kw, recompute)
    assert sum(sizes) == c.num_layers
    want = by_definition(sizes, recompute)
    ran_twice, _ = run_chunks(c)
    assert ran_twice == want
    assert replayed_layer_count(c, c.gpt_config()) == want
    model, run = flop_counts(c, c.gpt_config())
    assert run - model == want * layer_forward_flops(c)
    # The posting plan's backward: F = I = W = 1 for the rank's forward, plus the replayed share.
    costs = plan_costs(c)
    assert costs.backward == pytest.approx(2 + want / c.num_layers, rel=1e-15)
    assert costs.weight_fraction == pytest.approx(1 / costs.backward, rel=1e-15)


@pytest.mark.parametrize("layout", ["pp2-v2", "pp2-first2"])
def test_the_replayed_flops_are_torchs_count_of_the_replay(layout):
    """torch's FLOP counter over the chunks with block recomputation, less without: the
    replayed layers' forward, the whole s x s attention as torch counts it."""
    kw, sizes = LAYOUTS[layout]
    block = RECOMPUTE["block1"]
    c = config(kw, block, global_batch_size=1)  # one microbatch: what run_chunks runs
    _, replaying = run_chunks(c)
    _, plain = run_chunks(config(kw, {}, global_batch_size=1))
    assert replaying - plain == by_definition(sizes, block) * layer_forward_flops(c, causal=False)


@settings(max_examples=100, deadline=None)
@given(
    p=st.integers(1, 4),
    v=st.integers(1, 3),
    per_chunk=st.integers(1, 5),
    extra=st.integers(0, 2),  # the first stage's extra layers per chunk (uneven stages)
    method=st.sampled_from(["uniform", "block"]),
    n=st.integers(1, 7),
)
def test_the_count_follows_the_definition_for_any_layout(p, v, per_chunk, extra, method, n):
    """p ranks of v chunks of per_chunk layers each, the first rank with v x extra layers more
    (uneven stages, when p > 1): block replays min(n, layers) of each chunk, uniform all."""
    v = v if p > 1 else 1  # interleaving needs 2 ranks or more
    sizes = [per_chunk + extra * (r == 0 and p > 1) for r in range(p) for _ in range(v)]
    kw = dict(num_layers=sum(sizes), pipeline_model_parallel_size=p)
    if v > 1:
        kw["num_virtual_stages_per_pipeline_rank"] = v
    if extra and p > 1:
        kw["decoder_first_pipeline_num_layers"] = v * (per_chunk + extra)
    recompute = dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=n)
    c = config(kw, recompute, global_batch_size=12)  # microbatches a multiple of p
    c.check(c.pp)  # a layout megart train takes
    want = by_definition(sizes, recompute)
    assert replayed_layer_count(c, c.gpt_config()) == want
    model, run = flop_counts(c, c.gpt_config())
    assert run - model == want * layer_forward_flops(c)
    assert plan_costs(c).backward == pytest.approx(2 + want / c.num_layers, rel=1e-15)


def test_no_layers_is_refused():
    """--recompute-num-layers 0 is refused, as Megatron-LM's config asks for 1 or more."""
    c = config({}, dict(recompute_granularity="full", recompute_method="block"))
    with pytest.raises(ConfigError, match="--recompute-num-layers 0"):
        dataclasses.replace(c, recompute_num_layers=0).gpt_config()


def test_megart_train_logs_the_replayed_layers_flops(tmp_path):
    """Two CPU ranks, pp2 interleaved (four chunks of 2 layers), block 1: 4 of the 8 layers
    replayed. The logged TFLOP/s x time x ranks is that count, not the one replaying all."""
    log = tmp_path / "run.jsonl"
    argv = [
        *"--num-layers 8 --hidden-size 16 --num-attention-heads 2 --seq-length 8".split(),
        *"--micro-batch-size 1 --global-batch-size 4 --train-iters 2 --eval-iters 0".split(),
        *"--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2".split(),
        *"--recompute-granularity full --recompute-method block --recompute-num-layers 1".split(),
        *["--log-jsonl", str(log)],
    ]
    status, out = launch(mw.run_cli, 2, argv, timeout=400)[0]
    assert status == 0, out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2
    c = config(LAYOUTS["pp2-v2"][0], RECOMPUTE["block1"])
    plain, _ = flop_counts(c, c.gpt_config())
    want = plain + 4 * layer_forward_flops(c)
    for r in records:
        logged = r["tflops_per_gpu"] * 1e12 * r["time_s"] * 2
        assert logged == pytest.approx(want, rel=1e-9)
        assert logged != pytest.approx(plain + 8 * layer_forward_flops(c), rel=1e-3)


@pytest.mark.parametrize("layout", ["pp2-v2", "pp2-first2", "pp2-zbv"])
def test_the_replayed_moe_layers_count_their_experts(layout):
    """Block 1 over chunks of a model whose even layers are MoE layers (4 experts of 24, top
    2): each chunk's first layer is replayed, and those that are MoE layers replay the experts'
    products (24 x 2 wide) in place of a dense MLP's 4h, written out per replayed layer."""
    kw, sizes = LAYOUTS[layout]
    moe = dict(num_experts=4, moe_ffn_hidden_size=24, moe_layer_freq="2", disable_bias_linear=True)
    c = config({**kw, **moe}, RECOMPUTE["block1"])
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if layout == "pp2-zbv":  # the V: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        starts = [0, 6, 2, 4]
    b, s, h = c.global_batch_size, c.seq_length, c.hidden_size
    want = 0
    for first in starts:  # the replayed layer of each chunk
        mlp = 2 * 2 * b * s * h * (24 * 2 if first % 2 == 0 else 4 * h)
        want += layer_forward_flops(c) - 16 * b * s * h * h + mlp
    model, run = flop_counts(c, c.gpt_config())
    assert run - model == want
