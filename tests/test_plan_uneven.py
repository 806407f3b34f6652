"""megart plan with uneven pipeline stages (--decoder-first/last-pipeline-num-layers): each
rank's memory from its own layers (against real megart train ranks), each stage's costs from its
own layers in the schedule simulator (per-stage costs, checked against a hand-computed 1F1B
timeline), an even split given as flags predicting exactly the even layout, and megart train's
refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megart import schedule as sched
from megart.cli.plan import main as plan_main
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models.stages import check_stages, rank_layer_counts, uneven
from megart.plan import activations as act
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout, layout_config
from megart.plan.memory import precision, rank_memory
from megart.plan.parameters import layer_tensors
from megart.plan.timing import layer_work, logits_work
from megart.training.config import TrainConfig
from plan_workers import held_bytes, plan_json
from test_plan_memory import LLAMA, SMALL, _layout
from test_plan_schedules import _simulations_of

GPU = load_profile("a100-80gb")


# --- the simulator's per-stage costs ------------------------------------------------------


@pytest.mark.parametrize("kind,p,m,v", [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2)])
@pytest.mark.parametrize("posted", [False, True])
def test_equal_stage_costs_are_the_uniform_simulation_and_theory(kind, p, m, v, posted):
    plan = sched.build(kind, p, m, v)
    uniform = sched.simulate(plan, 1.0, 2.0, posted=posted)
    listed = sched.simulate(plan, 1.0, 2.0, posted=posted, stage_forward=[1.0] * p,
                            stage_backward=[2.0] * p)  # fmt: skip
    assert listed.makespan == uniform.makespan
    assert listed.bubble_fraction == pytest.approx(sched.theoretical_bubble(kind, p, m, v))


@pytest.mark.parametrize("posted", [False, True])
def test_unequal_stage_costs_follow_a_hand_computed_1f1b_timeline(posted):
    """p 2, m 3; rank 0 F 1 B 2, rank 1 F 2 B 4, messages free. Rank 0 runs F0 F1 B0 F2 B1
    B2, rank 1 F0 B0 F1 B1 F2 B2; each waits for its input:
    rank 0: F0 0-1, F1 1-2, B0 7-9 (rank 1's B0 ends at 7), F2 9-10, B1 13-15, B2 19-21;
    rank 1: F0 1-3, B0 3-7, F1 7-9, B1 9-13, F2 13-15 (rank 0's F2 ended at 10), B2 15-19.
    Makespan 21; the busiest rank computes 3 x 6 = 18; bubble 3 / 18."""
    sim = sched.simulate(
        sched.build("1f1b", 2, 3), stage_forward=[1, 2], stage_backward=[2, 4], posted=posted
    )
    want = [
        [("F", 0, 1), ("F", 1, 2), ("B", 7, 9), ("F", 9, 10), ("B", 13, 15), ("B", 19, 21)],
        [("F", 1, 3), ("B", 3, 7), ("F", 7, 9), ("B", 9, 13), ("F", 13, 15), ("B", 15, 19)],
    ]
    got = [[(s.action.op, s.start, s.end) for s in r.compute] for r in sim.ranks]
    assert got == want
    assert sim.makespan == 21
    assert [r.busy for r in sim.ranks] == [9, 18]
    assert sim.bubble_fraction == pytest.approx(3 / 18)


def test_stage_cost_lists_must_give_one_cost_per_rank():
    with pytest.raises(ConfigError, match="one cost per pipeline rank"):
        sched.simulate(sched.build("1f1b", 4, 8), stage_forward=[1, 1], stage_backward=[2, 2])
    with pytest.raises(ConfigError, match="finite and non-negative"):
        sched.simulate(sched.build("1f1b", 2, 2), stage_forward=[1, -1], stage_backward=[2, 2])


# --- memory against real ranks ------------------------------------------------------------

CASES = [
    (
        "pp4 1f1b first 3 last 1",
        dict(SMALL, num_layers=8),
        dict(
            pipeline_model_parallel_size=4,
            decoder_first_pipeline_num_layers=3,
            decoder_last_pipeline_num_layers=1,
            micro_batch_size=1,
        ),
    ),
    (
        "pp4 v2 first 2 last 4 llama-style",
        dict(LLAMA, num_layers=10),
        dict(
            pipeline_model_parallel_size=4,
            num_virtual_stages_per_pipeline_rank=2,
            decoder_first_pipeline_num_layers=2,
            decoder_last_pipeline_num_layers=4,
            micro_batch_size=1,
        ),
    ),
]


@pytest.mark.parametrize("name,model,flags", CASES, ids=[c[0] for c in CASES])
def test_predicted_bytes_are_what_an_uneven_rank_holds(name, model, flags):
    kw = {**model, **flags}
    config = TrainConfig(**kw)
    layout = _layout(config, 4)
    plan = estimate(config, layout, GPU)
    c = layout_config(config, layout)
    totals = {}
    for held in launch(held_bytes, 4, kw, timeout=300):
        r = held["pp_rank"]
        want = rank_memory(c, layout, 1, r, plan.peak_in_flight[r], dp_rank=held["dp_rank"])
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])
        assert held["saved_peak"] == pytest.approx(want["saved"], rel=0.01), (name, held, want)
        totals[r] = want["total"]
    assert plan.memory["total"] == max(totals.values())  # the worst rank, whichever it is


# --- an even split given as flags ---------------------------------------------------------

EVEN = dict(
    num_layers=8,
    hidden_size=256,
    num_attention_heads=8,
    seq_length=256,
    vocab_size=5000,
    global_batch_size=32,
    bf16=True,
)


@pytest.mark.parametrize(
    "chunks,schedule,first,last",
    [(1, None, 2, 2), (1, None, 2, None), (1, None, None, 2), (2, None, 2, 2), (1, "zb-h1", 2, 2)],
)
@pytest.mark.parametrize("simulate", [False, True])
def test_an_even_split_given_as_flags_is_the_even_prediction(
    chunks, schedule, first, last, simulate
):
    base = TrainConfig(**EVEN)
    even = Layout(1, 4, 2, chunks, 1, False, None, True, schedule)
    flagged = dataclasses.replace(even, first=first, last=last)
    a = estimate(base, even, GPU, simulate=simulate)
    b = estimate(base, flagged, GPU, simulate=simulate)
    assert b.memory == a.memory
    assert b.time == a.time
    assert b.bubble_fraction == a.bubble_fraction
    assert b.peak_in_flight == a.peak_in_flight
    assert b.tflops_per_gpu == a.tflops_per_gpu


# --- moving layers off the last stage -----------------------------------------------------

# A large vocabulary: the last stage's output layer and fp32 logits make it the worst rank.
BIG_VOCAB = dict(
    num_layers=12,
    hidden_size=128,
    num_attention_heads=4,
    seq_length=512,
    vocab_size=32000,
    global_batch_size=4,
)


def test_moving_layers_off_the_last_stage_lowers_the_worst_rank():
    """Even pp4 (3 layers each), one microbatch in flight per rank: the last rank is the worst
    (output layer and fp32 logits on top of the first rank's embedding). Giving it 2 layers and
    the first 4 takes exactly one layer's parameters, gradients, AdamW state and activations
    off it, and the first rank stays below it, so the worst rank lowers by that much."""
    base = TrainConfig(**BIG_VOCAB)
    even = Layout(1, 4, 1, 1, 4, False, None, False)
    uneven = dataclasses.replace(even, first=4, last=2)
    a, b = estimate(base, even, GPU), estimate(base, uneven, GPU)
    assert a.microbatches == 1
    c = layout_config(base, even)
    per_rank = [rank_memory(c, even, 1, r, 1)["total"] for r in range(4)]
    assert a.memory["total"] == per_rank[3] == max(per_rank)  # the last is the worst, even
    cfg = base.gpt_config()
    tensors = layer_tensors(cfg, 1)
    # fp32 weight, gradient, two moments and a step per tensor; the layer's saved activations
    one_layer = sum(tensors) * 16 + len(tensors) * 4
    one_layer += act.layer_bytes(cfg, 4, 1, False, None, precision(c, "megart"))
    assert b.memory["total"] == pytest.approx(a.memory["total"] - one_layer, rel=1e-12)
    assert b.memory["total"] < a.memory["total"]
    # Three more layers onto the first rank (6 | 2 | 2 | 2): the last, still the worst with the
    # same 2 layers, sets the same worst-rank memory.
    far = estimate(base, dataclasses.replace(even, first=6, last=2), GPU)
    assert far.memory["total"] == b.memory["total"]


def test_moving_layers_onto_the_worst_first_stage_raises_it():
    """A small vocabulary and m = 8 >= p: the first rank, holding p = 4 microbatches in flight
    (1F1B) and the embedding, is the worst; moving a layer off the last onto it raises the
    worst rank by that layer's state and 4 microbatches' activations."""
    base = TrainConfig(**dict(BIG_VOCAB, vocab_size=256, global_batch_size=8))
    even = Layout(1, 4, 1, 1, 1, False, None, False)
    a = estimate(base, even, GPU)
    b = estimate(base, dataclasses.replace(even, first=4, last=2), GPU)
    c = layout_config(base, even)
    assert a.memory["total"] == rank_memory(c, even, 1, 0, 4)["total"]
    cfg = base.gpt_config()
    tensors = layer_tensors(cfg, 1)
    one_layer = sum(tensors) * 16 + len(tensors) * 4
    one_layer += 4 * act.layer_bytes(cfg, 1, 1, False, None, precision(c, "megart"))
    assert b.memory["total"] == pytest.approx(a.memory["total"] + one_layer, rel=1e-12)


@pytest.mark.parametrize(
    "first,last", [(4, 2), (2, 4), (None, 3), (5, 1), (6, None), (2, 2)]
)  # fmt: skip
def test_iteration_never_beats_the_slowest_stage(first, last):
    """Stage costs follow each rank's layers (the output layer's on the last), and the
    simulated iteration is never below m times the slowest stage's forward and backward."""
    base = TrainConfig(**dict(BIG_VOCAB, num_layers=12, global_batch_size=32))
    layout = Layout(1, 4, 1, 1, 1, False, None, False, None, first, last)
    check_stages(12, 4, 1, first, last)
    e, calls = _simulations_of(lambda: estimate(base, layout, GPU))
    cfg = layout_config(base, layout).gpt_config()
    per_layer = layer_work(cfg, 1, 1, False, None, GPU)
    logits = logits_work(cfg, 1, 1, GPU)
    counts = rank_layer_counts(12, 4, first, last)
    stages = [per_layer * n for n in counts]
    stages[-1] = stages[-1] + logits
    slowest = max(w.forward + w.backward for w in stages)
    if len(set(counts)) > 1:
        assert [w.forward for w in e.stages] == pytest.approx([w.forward for w in stages])
        assert [w.backward for w in e.stages] == pytest.approx([w.backward for w in stages])
        # Simulated with each stage's own costs: the stages other than the slowest fill and
        # drain faster than it, so with a posting plan made for those costs the bubble is below
        # equal stages' (p - 1) / m (the output layer's stage is the slowest by far here;
        # messages take microseconds). megart train's plan is made for equal stages
        # (training.pipeline_costs), and the planner's bubble is that plan's.
        ((args, kwargs),) = calls
        own = sched.simulate(*args, **dict(kwargs, planned_for=None))
        assert own.bubble_fraction < sched.theoretical_bubble("1f1b", 4, e.microbatches)
        assert e.bubble_fraction == sched.simulate(*args, **kwargs).bubble_fraction
    assert e.iteration_time >= e.microbatches * slowest * (1 - 1e-12)
    assert e.time["compute"] + e.time["tp_comm"] == pytest.approx(e.microbatches * slowest)


def test_unloading_the_last_stage_shortens_the_iteration():
    """The last stage adds the output layer: with it the slowest at an even split, one layer
    moved to the first stage shortens the iteration (simulated with unequal stages)."""
    base = TrainConfig(**dict(BIG_VOCAB, global_batch_size=32))
    even = Layout(1, 4, 1, 1, 1, False, None, False)
    a = estimate(base, even, GPU)
    b = estimate(base, dataclasses.replace(even, first=4, last=2), GPU)
    assert b.iteration_time < a.iteration_time
    assert b.stage.forward + b.stage.backward < a.stage.forward + a.stage.backward


# --- drawn layouts ------------------------------------------------------------------------


@st.composite
def _uneven_layouts(draw: st.DrawFn) -> tuple[TrainConfig, Layout]:
    p = draw(st.sampled_from([2, 3, 4]))
    kind = draw(st.sampled_from(["1f1b", "interleaved", "zb-h1"]))
    v = draw(st.sampled_from([2, 3])) if kind == "interleaved" else 1
    first = draw(st.one_of(st.none(), st.integers(1, 4).map(lambda n: n * v)))
    last = draw(st.one_of(st.none(), st.integers(1, 4).map(lambda n: n * v)))
    middle = draw(st.integers(1, 3)) * v  # each middle rank's layers
    mids = p - (first is not None) - (last is not None)
    assume(uneven(first, last) and not (mids == 0 and v > 1))
    layers = (first or 0) + (last or 0) + mids * middle
    check_stages(layers, p, v, first, last)
    b = draw(st.sampled_from([1, 2]))
    m = p * draw(st.integers(1, 3))
    model = TrainConfig(
        num_layers=layers,
        hidden_size=draw(st.sampled_from([64, 128])),
        num_attention_heads=4,
        seq_length=draw(st.sampled_from([32, 128])),
        vocab_size=draw(st.sampled_from([256, 5000])),
        global_batch_size=b * m,
        untie_embeddings_and_output_weights=draw(st.booleans()),
        bf16=draw(st.booleans()),
    )
    rec = draw(st.sampled_from([None, "selective", "full"]))
    schedule = "zb-h1" if kind == "zb-h1" else None
    return model, Layout(1, p, 1, v, b, False, rec, False, schedule, first, last)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_uneven_layouts(), st.booleans())
def test_drawn_uneven_predictions_are_finite_and_positive(drawn, simulate):
    base, layout = drawn
    e = estimate(base, layout, GPU, simulate=simulate)
    for x in (e.iteration_time, e.memory["total"], e.tflops_per_gpu, e.memory["parameters"]):
        assert math.isfinite(x) and x > 0
    assert all(math.isfinite(x) and x >= 0 for x in (*e.time.values(), *e.memory.values()))
    assert e.iteration_time >= e.microbatches * (e.stage.forward + e.stage.backward) * (1 - 1e-9)


# --- the command line ---------------------------------------------------------------------

ARGV = (
    "--gpu a100-80gb --num-gpus 8 --num-layers 8 --hidden-size 512 --num-attention-heads 8 "
    "--seq-length 512 --vocab-size 1000 --global-batch-size 16 --pipeline-model-parallel-size 4"
)


def test_plan_predicts_uneven_stages_and_keeps_its_json(capsys):
    even = plan_json(ARGV, capsys)
    argv = ARGV + " --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 1"
    out = plan_json(argv, capsys)

    def shape(x: object) -> object:  # the keys, nested
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items()}
        return [shape(x[0])] if isinstance(x, list) and x else None

    assert shape(out["candidates"][0]) == shape(even["candidates"][0])
    assert set(out) == set(even)
    flags = out["layout"]["flags"]
    assert "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 1" in flags
    assert out["pipeline_schedule"] != "zb-v"  # megart train refuses it with uneven stages


PLAN_MODEL = dict(  # ARGV's
    EVEN,
    hidden_size=512,
    seq_length=512,
    vocab_size=1000,
    global_batch_size=16,
    pipeline_model_parallel_size=4,
    micro_batch_size=1,
)


@pytest.mark.parametrize(
    "extra,train",
    [
        ("--decoder-last-pipeline-num-layers 3", dict(decoder_last_pipeline_num_layers=3)),
        ("--decoder-first-pipeline-num-layers 0", dict(decoder_first_pipeline_num_layers=0)),
        (
            "--decoder-first-pipeline-num-layers 2 --num-layers-per-virtual-pipeline-stage 1",
            dict(decoder_first_pipeline_num_layers=2, num_layers_per_virtual_pipeline_stage=1),
        ),
        (
            "--decoder-first-pipeline-num-layers 3 --num-virtual-stages-per-pipeline-rank 2",
            dict(decoder_first_pipeline_num_layers=3, num_virtual_stages_per_pipeline_rank=2),
        ),
        (
            "--decoder-first-pipeline-num-layers 2 --pipeline-schedule zb-v",
            dict(decoder_first_pipeline_num_layers=2, pipeline_schedule="zb-v"),
        ),
    ],
)
def test_plan_refuses_what_megart_train_refuses_in_its_words(extra, train, capsys):
    assert plan_main((ARGV + " " + extra).split()) == 2
    err = capsys.readouterr().err
    with pytest.raises(ConfigError) as refused:
        TrainConfig(**PLAN_MODEL, **train).check(8)
    assert f"megart plan: error: {refused.value}" in err


def test_plan_needs_the_pipeline_size_with_uneven_stages(capsys):
    argv = ARGV.replace(" --pipeline-model-parallel-size 4", "")
    assert plan_main((argv + " --decoder-last-pipeline-num-layers 2").split()) == 2
    assert "need --pipeline-model-parallel-size" in capsys.readouterr().err
