"""megart plan: the published tables, the bubble against the simulator and theory, properties
over layouts (hypothesis), the search's fixed flags and node-bound tensor parallelism, and
TFLOP/s under selective recomputation. The command line and its errors:
test_plan_cli.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megart import schedule as sched
from megart.plan import GPUS, Fixed, Layout, estimate, load_profile, search
from megart.plan.holding import theory_in_flight
from megart.plan.published import TABLES, config, fixed, model_options, published_layout
from megart.training.config import TrainConfig

SC21, MCORE = TABLES
ROWS = [(table, row) for table in TABLES for row in table.rows]


@pytest.mark.parametrize("table,row", ROWS, ids=[f"{t.name.split()[0]}-{r.name}" for t, r in ROWS])
def test_predicted_tflops_are_within_10_percent_of_every_published_row(table, row):
    gpu = load_profile(table.gpu)
    best = search(
        config(table, row), row.gpus, gpu, fixed(table, row), keep=1, **model_options(table)
    )[0]
    value = best.tflops_per_gpu if table.counts_recompute else best.model_tflops_per_gpu
    assert best.fits
    assert value == pytest.approx(row.tflops, rel=0.10)


@pytest.mark.parametrize("row", SC21.rows, ids=[r.name for r in SC21.rows])
def test_at_table1s_exact_layout_tflops_are_within_10_percent(row):
    # The runs' own micro batch and interleaving (Megatron-LM examples/sc21), not searched.
    e = estimate(
        config(SC21, row), published_layout(row), load_profile(SC21.gpu), **model_options(SC21)
    )
    assert e.fits
    assert e.tflops_per_gpu == pytest.approx(row.tflops, rel=0.10)


# Where the planner's own choice for Table 1 is neither the paper's (t, p) nor within 3% of
# it: recorded in bench/RESULTS.md. strict: a model that starts agreeing must say so here.
# Table 1 is a weak-scaling series (d = 32 on its first six rows) whose (t, p) follow the
# paper's rule: tensor parallelism up to a node, then pipeline. On the larger three, the six
# all-reduces per layer and microbatch at t = 8 (recomputation replays two) cost more than the
# bubble and blocking exchanges of t = 2 or 4 with more stages; 39.1B's (8, 2) cannot
# interleave (SC21's Megatron-LM asserted p > 2 for it), so it keeps a 1/m bubble. (3.6B and
# 7.5B, where the planner preferred half the paper's t with twice its d, agree since the
# gradient copies SC21's Megatron-LM held are counted: tests/test_plan_grad_copies.py.)
LESS_T_MORE_P = (
    "the planner prefers less tensor parallelism (its t = 8 all-reduces outweigh the bubble)"
)
DISAGREES = {
    "18.4B": (LESS_T_MORE_P, "+12.0%"),
    "39.1B": (LESS_T_MORE_P, "+15.8%"),
    "145.6B": (LESS_T_MORE_P, "+4.8%"),
}


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            r,
            marks=pytest.mark.xfail(
                strict=True,
                reason=f"{DISAGREES[r.name][0]}; the paper's (t, p) is {DISAGREES[r.name][1]} "
                "slower in its model",
            ),
        )
        if r.name in DISAGREES
        else r
        for r in SC21.rows
    ],
    ids=[r.name for r in SC21.rows],
)
def test_table1_recommendation_is_the_papers_or_within_3_percent(row):
    gpu = load_profile(SC21.gpu)
    options = model_options(SC21)
    chosen = search(config(SC21, row), row.gpus, gpu, fixed(SC21), keep=1, **options)[0]
    papers = search(config(SC21, row), row.gpus, gpu, fixed(SC21, row), keep=1, **options)[0]
    same = (chosen.layout.tp, chosen.layout.pp) == (row.tp, row.pp)
    assert same or papers.iteration_time <= 1.03 * chosen.iteration_time


def test_blocking_pipeline_exchanges_are_paid_by_every_microbatch_and_the_bubble():
    # SC21's Megatron-LM waited for every exchange: each microbatch pays one message after its
    # forward and one after its backward, and the bubble stretches with them.
    gpu = load_profile("a100-80gb")
    base = TrainConfig(**MODEL, global_batch_size=32)
    layout = Layout(1, 2, 8, 1, 1, False, None, False)  # d = 8 fills a node: stages cross rails
    m, p = 4, 2
    message = MODEL["seq_length"] * MODEL["hidden_size"] * 2  # 16-bit, b = 1, t = 1
    one = gpu.link_latency_us * 1e-6 + message / (gpu.rail_gb_per_s * 1e9)
    for simulate in (False, True):
        blocked = estimate(base, layout, gpu, simulate, runtime="megatron", pp_overlap=False)
        overlapped = estimate(base, layout, gpu, simulate, runtime="megatron")
        assert blocked.time["pp_comm"] == pytest.approx(2 * m * one * (1 + (p - 1) / m))
        assert blocked.iteration_time > overlapped.iteration_time
        assert blocked.bubble_fraction == pytest.approx((p - 1) / m)


def _free(gpu):
    """The profile with communication made free: the bubble is then the schedule's alone."""
    return dataclasses.replace(
        gpu, link_latency_us=1e-12, rail_gb_per_s=1e15, nvlink_bus_gb_per_s=1e15
    )


MODEL = dict(
    num_layers=16,
    hidden_size=1024,
    num_attention_heads=16,
    seq_length=1024,
    vocab_size=32000,
    bf16=True,
)


@settings(max_examples=25, deadline=None)
@given(
    p=st.sampled_from([2, 4, 8]),
    groups=st.integers(1, 4),
    v=st.sampled_from([1, 2]),
)
def test_the_bubble_is_the_simulators_which_is_theorys(p, groups, v):
    gpu = _free(load_profile("h100-80gb"))
    m = p * groups
    base = TrainConfig(**MODEL, global_batch_size=m)
    layout = Layout(1, p, 1, v, 1, False, None, False)
    simulated = estimate(base, layout, gpu)
    assert simulated.bubble_fraction == pytest.approx(
        sched.theoretical_bubble("interleaved" if v > 1 else "1f1b", p, m, v), abs=1e-9
    )
    quick = estimate(base, layout, gpu, simulate=False)
    assert quick.bubble_fraction == pytest.approx(simulated.bubble_fraction, abs=1e-9)
    assert simulated.peak_in_flight == theory_in_flight(p, m, v)
    assert quick.iteration_time == pytest.approx(simulated.iteration_time, rel=1e-6)


layouts = st.builds(
    Layout,
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 4]),
    dp=st.sampled_from([1, 2, 8]),
    chunks=st.sampled_from([1, 2]),
    micro_batch=st.sampled_from([1, 2, 4]),
    sequence_parallel=st.booleans(),
    recompute=st.sampled_from([None, "selective", "full"]),
    distributed_optimizer=st.booleans(),
)


def _valid(layout: Layout, batch_groups: int) -> tuple[TrainConfig, Layout] | None:
    if layout.chunks > 1 and layout.pp == 1:
        return None
    m = layout.pp * batch_groups
    base = TrainConfig(**MODEL, global_batch_size=m * layout.micro_batch * layout.dp)
    return base, layout


@settings(max_examples=40, deadline=None)
@given(layout=layouts, groups=st.integers(1, 4), gpu=st.sampled_from(GPUS))
def test_predictions_are_finite_positive_and_monotone(layout, groups, gpu):
    made = _valid(layout, groups)
    if made is None:
        return
    base, layout = made
    profile = load_profile(gpu)
    e = estimate(base, layout, profile, simulate=False)
    for value in [*e.time.values(), *e.memory.values(), e.tflops_per_gpu, e.mfu]:
        assert math.isfinite(value) and value >= 0
    assert e.iteration_time > 0 and e.memory["total"] > 0 and 0 < e.mfu < 1
    # More microbatches never increase the bubble fraction.
    more = dataclasses.replace(base, global_batch_size=2 * base.global_batch_size)
    assert estimate(more, layout, profile, simulate=False).bubble_fraction <= e.bubble_fraction
    # Full recomputation never holds more activations than selective, nor selective than none.
    held = [
        estimate(base, dataclasses.replace(layout, recompute=r), profile, simulate=False).memory[
            "activations"
        ]
        for r in ("full", "selective", None)
    ]
    assert held[0] <= held[1] <= held[2]
    # The distributed optimizer never holds more optimizer state.
    on = dataclasses.replace(layout, distributed_optimizer=True)
    off = dataclasses.replace(layout, distributed_optimizer=False)
    assert (
        estimate(base, on, profile, simulate=False).memory["optimizer"]
        <= estimate(base, off, profile, simulate=False).memory["optimizer"]
    )
    # An fp32 residual stream never needs less memory than the 16-bit one (each rank holds
    # more activations, so the worst rank's total grows, though which rank is worst can
    # change), nor does it shorten the iteration (its pipeline messages are twice the bytes).
    half = dataclasses.replace(base, bf16=True)
    wide = dataclasses.replace(half, fp32_residual_connection=True)
    narrow_e, wide_e = (estimate(c, layout, profile, simulate=False) for c in (half, wide))
    assert narrow_e.memory["total"] <= wide_e.memory["total"]
    assert narrow_e.iteration_time <= wide_e.iteration_time
    # --half-weights never needs more memory: 2 + 4 bytes of weight and main weight where fp32
    # weights take 4 + a 2-byte autocast copy, the main weights sharded with the moments
    # (padding aside, a bucket's few elements).
    halved = estimate(dataclasses.replace(half, half_weights=True), layout, profile, simulate=False)
    assert halved.memory["autocast_copies"] == 0
    assert halved.memory["total"] <= narrow_e.memory["total"] + 64 * 4 * base.num_layers


def test_fixed_flags_are_kept():
    gpu = load_profile("h100-80gb")
    base = TrainConfig(**{**MODEL, "global_batch_size": 64})
    found = search(base, 16, gpu, Fixed(tp=2, recompute="full", distributed_optimizer=True))
    assert found and all(
        e.layout.tp == 2 and e.layout.recompute == "full" and e.layout.distributed_optimizer
        for e in found
    )


def test_searched_tensor_parallel_groups_stay_inside_a_node():
    gpu = load_profile("a100-80gb")
    base = TrainConfig(
        **{**MODEL, "num_attention_heads": 48, "hidden_size": 3072, "global_batch_size": 96}
    )
    found = search(base, 48, gpu, keep=50)
    assert found and all(gpu.gpus_per_node % e.layout.tp == 0 for e in found)

    # Asked for, a group across nodes pays the rails' bandwidth.
    def tp_comm(tp: int) -> float:
        only = Fixed(
            tp=tp,
            pp=1,
            micro_batch=1,
            recompute=None,
            sequence_parallel=False,
            distributed_optimizer=False,
        )
        return search(base, 48, gpu, only)[0].time["tp_comm"]

    assert tp_comm(6) > 3 * tp_comm(4)


def test_tflops_count_selective_recomputations_replayed_cores():
    """Under selective recomputation TFLOP/s count what runs, as under full: the model's FLOPs
    and every layer's attention core again (the paper's whole s x s); MFU the model's alone."""
    gpu = load_profile("a100-80gb")
    base = TrainConfig(**MODEL, global_batch_size=8)
    b, s, h, l = 8, MODEL["seq_length"], MODEL["hidden_size"], MODEL["num_layers"]
    for recompute, again in (("selective", l * 4 * b * s * s * h), (None, 0)):
        e = estimate(base, Layout(1, 1, 1, 1, 1, False, recompute, False), gpu)
        flops_per_tflop = e.iteration_time * 1e12  # one GPU
        ran, model = e.tflops_per_gpu * flops_per_tflop, e.model_tflops_per_gpu * flops_per_tflop
        assert ran - model == pytest.approx(again, rel=1e-9, abs=1.0)
