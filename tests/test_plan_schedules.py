"""megart plan with every pipeline schedule megart train runs (1f1b, interleaved, zb-h1,
zb-v): the bubble is the C++ simulator's (with equal F, I, W times: the closed forms; with the
plan's own times: Qi et al.'s ZB-H1 formula), the in-flight counts the schedules', and the
--pipeline-schedule flag is honoured or refused as megart train would."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megart import schedule as sched
from megart.cli.main import main as megart_main
from megart.errors import ConfigError
from megart.plan import Fixed, Layout, estimate, load_profile, pipeline_run, search
from megart.plan.holding import theory_in_flight
from megart.plan.layout import layout_config
from megart.plan.timing import Work
from megart.training.config import TrainConfig
from megart.training.pipeline_costs import plan_costs
from test_plan import MODEL, _free
from test_plan_cli import BIG

CHUNKS = {"1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-v": 2}
CLOSED_FORM = {"1f1b": 1, "interleaved": 2, "zb-h1": 3, "zb-v": 6}  # (p-1)/(k m)


def _layout(kind: str, p: int) -> Layout:
    schedule = kind if kind.startswith("zb") else None
    return Layout(1, p, 1, CHUNKS[kind], 1, False, None, False, schedule)


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(sorted(CHUNKS)),
    p=st.sampled_from([2, 4, 8]),
    groups=st.integers(2, 5),
    simulate=st.booleans(),
)
def test_with_equal_times_the_bubble_is_the_simulators_and_the_closed_form(
    kind, p, groups, simulate
):
    m = p * groups  # a multiple of p, at least 2p: every kind runs
    base = TrainConfig(**MODEL, global_batch_size=m)
    gpu = _free(load_profile("h100-80gb"))
    # Each layer: forward 1, backward 2 of which weight gradients 1 (T_F = T_I = T_W).
    with (
        mock.patch("megart.plan.estimate.layer_work", return_value=Work(1.0, 2.0, 0.0, 1.0)),
        mock.patch("megart.plan.estimate.logits_work", return_value=Work(0.0, 0.0, 0.0, 0.0)),
    ):
        e = estimate(base, _layout(kind, p), gpu, simulate=simulate)
    v = CHUNKS[kind]
    sim = sched.simulate(sched.build(kind, p, m, v), 1.0, 2.0, weight_fraction=0.5)
    assert e.bubble_fraction == pytest.approx(sim.bubble_fraction, abs=1e-9)
    assert e.bubble_fraction == pytest.approx((p - 1) / (CLOSED_FORM[kind] * m), abs=1e-9)
    assert e.peak_in_flight == [r.peak_stashed for r in sim.ranks]
    assert e.peak_in_flight == theory_in_flight(p, m, v, kind)


@settings(max_examples=20, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), groups=st.integers(2, 4), rec=st.sampled_from([None, "full"]))
def test_with_the_plans_own_times_zero_bubble_beats_1f1b(p, groups, rec):
    m = p * groups
    base = TrainConfig(**MODEL, global_batch_size=m)
    gpu = _free(load_profile("h100-80gb"))
    plans, calls = {}, {}
    for k in ("1f1b", "zb-h1", "zb-v"):
        layout = dataclasses.replace(_layout(k, p), recompute=rec)
        plans[k], calls[k] = _simulations_of(lambda lay=layout: estimate(base, lay, gpu))
    s = plans["zb-h1"].stage
    t_f, t_w = s.forward, s.weight
    t_i = s.backward - t_w
    assert 0 < t_w < t_i  # the weight-gradient products are part of the backward
    # Qi et al.: ZB-H1's bubble is (p-1)(T_F + T_I - T_W), for a plan made for these times
    # (megart train's is made for fixed ratios: the planner's bubble is that plan's).
    zb_h1 = (p - 1) * (t_f + t_i - t_w) / (m * (t_f + t_i + t_w))
    ((args, kwargs),) = calls["zb-h1"]
    own = sched.simulate(*args, **dict(kwargs, planned_for=None))
    assert own.bubble_fraction == pytest.approx(zb_h1, rel=1e-6)
    assert plans["zb-h1"].bubble_fraction == pytest.approx(
        sched.simulate(*args, **kwargs).bubble_fraction, rel=1e-12
    )
    # (zb-v's "at most half of zb-h1's" holds for equal times, not for these: with
    # recomputation T_I is far above T_W.)
    for k in ("zb-h1", "zb-v"):
        assert plans[k].bubble_fraction < plans["1f1b"].bubble_fraction
        assert plans[k].iteration_time < plans["1f1b"].iteration_time
    for k, e in plans.items():
        v = CHUNKS[k]
        assert e.peak_in_flight == theory_in_flight(p, m, v, k)
        held = e.held_for_weights
        assert all(0 <= w <= n for w, n in zip(held, e.peak_in_flight, strict=True))
        assert k.startswith("zb") or not any(held)


def test_weight_gradients_held_between_i_and_w_cost_memory():
    # With full recomputation a pair between F and I keeps one tensor per layer; between I
    # and W it keeps every deferred layer's input and output gradient: zb-h1 holds more than
    # 1F1B, which frees a pair at its backward.
    base = TrainConfig(**MODEL, global_batch_size=16)
    gpu = load_profile("h100-80gb")
    one = estimate(base, Layout(1, 4, 1, 1, 1, False, "full", False), gpu)
    zb = estimate(base, Layout(1, 4, 1, 1, 1, False, "full", False, "zb-h1"), gpu)
    assert one.memory["weight_grads"] == 0 < zb.memory["weight_grads"]
    assert zb.memory["activations"] > one.memory["activations"]


@pytest.mark.parametrize("kind", ["zb-h1", "zb-v", "1f1b", "interleaved"])
def test_an_asked_schedule_is_kept_and_named_in_the_flags(kind, capsys):
    flags = ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", kind]
    assert megart_main(["plan", "--gpu", "h100-80gb", "--num-gpus", "32", *BIG, *flags]) == 0
    out = capsys.readouterr().out
    assert "recommended: megart train" in out
    recommended = out.split("recommended: ")[1]
    assert (f"--pipeline-schedule {kind}" in recommended) == kind.startswith("zb")
    assert ("--num-layers-per-virtual-pipeline-stage" in recommended) == (kind == "interleaved")


def test_the_search_includes_zero_bubble_schedules_for_megart_only():
    base = TrainConfig(**MODEL, global_batch_size=64)
    gpu = load_profile("h100-80gb")
    found = search(base, 8, gpu, Fixed(tp=1, pp=4), keep=100)
    assert {e.layout.kind for e in found} == {"1f1b", "interleaved", "zb-h1", "zb-v"}
    found = search(base, 8, gpu, Fixed(tp=1, pp=4), keep=100, runtime="megatron")
    assert {e.layout.kind for e in found} == {"1f1b", "interleaved"}


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", "2"]
            + ["--num-layers-per-virtual-pipeline-stage", "6"],
            "--pipeline-schedule zb-h1 runs one model chunk per rank",
        ),
        (
            ["--pipeline-schedule", "zb-v", "--pipeline-model-parallel-size", "4"]
            + ["--micro-batch-size", "64", "--tensor-model-parallel-size", "8"],
            "--pipeline-schedule zb-v needs at least 2 x pipeline size = 8 microbatches",
        ),
        (
            ["--pipeline-schedule", "zb-v", "--runtime", "megatron"],
            "Megatron-LM has no zero-bubble schedule",
        ),
    ],
)
def test_impossible_schedules_are_refused_once_with_what_would_run(flags, message, capsys):
    assert megart_main(["plan", "--gpu", "a100-80gb", "--num-gpus", "32", *BIG, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megart plan: error: ") and err.count("\n") == 0
    assert message in err


def test_a_layout_whose_chunks_do_not_match_its_schedule_is_refused():
    base = TrainConfig(**MODEL, global_batch_size=16)
    with pytest.raises(ConfigError, match="zb-v runs 2 model chunk"):
        estimate(base, Layout(1, 2, 1, 1, 1, False, None, False, "zb-v"), load_profile("h200"))


def _simulations_of(run):
    """run()'s result and the (args, kwargs) of each simulation it ran (none cached)."""
    calls = []
    real = sched.simulate

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    pipeline_run._simulated.cache_clear()
    with mock.patch.object(sched, "simulate", spy):
        return run(), calls


def _plan_costs_of(costs: sched.Costs) -> tuple[float, ...]:
    return costs.forward, costs.backward, costs.weight_fraction, costs.latency


@pytest.mark.parametrize("kind", sorted(CHUNKS))
def test_megarts_posting_plan_is_simulated_as_megart_train_makes_it(kind):
    """The planner times the posting plan megart train posts: made for the fixed ratios of
    training.pipeline_costs.plan_costs (what Trainer.engine_for gives the engine: the runtime
    cannot measure its layers and links before it runs), not for the predicted costs it is
    timed with. Megatron-LM's runtime posts no plan."""
    base = TrainConfig(**MODEL, global_batch_size=16)
    layout = _layout(kind, 4)
    for runtime in ("megart", "megatron"):
        if runtime == "megatron" and kind.startswith("zb"):
            continue  # Megatron-LM has no zero-bubble schedule
        _, calls = _simulations_of(
            lambda r=runtime: estimate(base, layout, load_profile("h200"), runtime=r)
        )
        seen = [kwargs for _, kwargs in calls]
        assert seen
        if runtime == "megatron":
            assert not any(k["posted"] for k in seen)
            continue
        runs = plan_costs(layout_config(base, layout))
        assert all(k["posted"] for k in seen)
        assert {_plan_costs_of(k["planned_for"]) for k in seen} == {_plan_costs_of(runs)}
