"""Property tests of the zero-bubble schedules (Qi et al., ICLR 2024) against theory: zb-h1 and
zb-v are valid and never deadlock for any F:I:W cost ratio; with equal costs and free
communication zb-h1's bubble is exactly (p-1)/(3m) and zb-v's at most half of it; zb-h1 never
holds more than p microbatches (F to W) on a rank, zb-v never more than 2p half-size chunks; and
both beat 1F1B on the same work for every m >= p > 1."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megart import schedule as sched
from megart.errors import ConfigError

# (t_f, t_i, t_w) in whole units; the simulator takes backward = t_i + t_w and W's share of it.
ratios = st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))


def _simulate(s, t_f, t_i, t_w, per_chunk=True, **comm):
    # The simulator's costs are for a rank's whole share of the model, each of v chunks taking
    # 1/v; per_chunk makes (t_f, t_i, t_w) one chunk's, else one rank's share (equal work).
    v = s.chunks if per_chunk else 1
    return sched.simulate(
        s,
        forward_time=t_f * v,
        backward_time=(t_i + t_w) * v,
        weight_fraction=t_w / (t_i + t_w),
        **comm,
    )


@st.composite
def zb_shapes(draw, kind=None):
    kind = kind or draw(st.sampled_from(("zb-h1", "zb-v")))
    p = draw(st.integers(1, 16))
    if kind == "zb-v":
        return kind, p, draw(st.integers(2 * p, 64)), 2
    return kind, p, draw(st.integers(1, 64)), 1


def _compute(actions):
    return [a for a in actions if a.is_compute]


@given(zb_shapes(), ratios)
def test_valid_no_deadlock_and_every_backward_split_once(shape, ratio):
    kind, p, m, v = shape
    s = sched.build(kind, p, m, v)
    assert sched.problems(s) == []
    for actions in s.ranks:
        ops = [(a.op, a.mb, a.chunk) for a in _compute(actions)]
        assert len(ops) == len(set(ops)) == 3 * m * v
        assert not any(op == "B" for op, _, _ in ops)
        for mb in range(m):
            for c in range(v):
                f, i, w = (ops.index((op, mb, c)) for op in "FIW")
                assert f < i < w
    sim = _simulate(s, *ratio)  # raises DeadlockError if stuck
    t_f, t_i, t_w = ratio
    assert math.isclose(sim.ideal, m * (t_f + t_i + t_w) * v, rel_tol=1e-12)


@given(zb_shapes("zb-h1"))
def test_zb_h1_bubble_is_exactly_p_minus_1_over_3m_with_equal_times(shape):
    _, p, m, _ = shape
    if m < p:  # the formula is the steady-state one; below p the pipeline never fills
        return
    sim = _simulate(sched.build("zb-h1", p, m), 1, 1, 1)
    assert math.isclose(sim.bubble_fraction, (p - 1) / (3 * m), rel_tol=1e-12, abs_tol=1e-15)
    assert sim.bubble_fraction == pytest.approx(sched.theoretical_bubble("zb-h1", p, m))
    # Bubble time (p-1)(T_F + T_I - T_W) = p - 1 units.
    assert math.isclose(sim.makespan - sim.ideal, p - 1, abs_tol=1e-9)


@given(zb_shapes("zb-v"))
def test_zb_v_bubble_is_at_most_half_of_zb_h1s(shape):
    _, p, m, v = shape
    sim = _simulate(sched.build("zb-v", p, m, v), 1, 1, 1)
    assert sim.bubble_fraction <= (p - 1) / (3 * m) / 2 + 1e-12
    assert sim.bubble_fraction == pytest.approx(sched.theoretical_bubble("zb-v", p, m, 2))


@given(zb_shapes(), ratios)
def test_peak_activations_within_the_bounds(shape, ratio):
    kind, p, m, v = shape
    sim = _simulate(sched.build(kind, p, m, v), *ratio)
    peaks = [r.peak_stashed for r in sim.ranks]
    if kind == "zb-h1":  # 1F1B's rank 0: p microbatches, on every rank
        assert max(peaks) <= min(p, m)
    else:  # 2p half-size chunks
        assert max(peaks) <= 2 * p


@given(st.integers(2, 16), st.integers(0, 48), ratios)
def test_both_strictly_better_than_1f1b_for_every_m_at_least_p(p, extra, ratio):
    m = p + extra
    # The same model on the same ranks: zb-v's chunks are half of a 1F1B stage.
    one = _simulate(sched.build("1f1b", p, m), *ratio, per_chunk=False)
    h1 = _simulate(sched.build("zb-h1", p, m), *ratio, per_chunk=False)
    assert h1.makespan < one.makespan
    if m >= 2 * p:
        zv = _simulate(sched.build("zb-v", p, m, 2), *ratio, per_chunk=False)
        assert zv.makespan < one.makespan


@given(zb_shapes(), st.floats(0.01, 2.0))
def test_latency_never_deadlocks_and_only_adds_time(shape, latency):
    kind, p, m, v = shape
    s = sched.build(kind, p, m, v)
    slow = sched.simulate(s, latency=latency)
    assert slow.makespan >= sched.simulate(s).makespan


def test_zb_v_places_its_chunks_in_a_v_and_turns_without_a_message():
    p = 4
    s = sched.build("zb-v", p, 8, 2)
    assert [s.virtual_stage(r, 0) for r in range(p)] == [0, 1, 2, 3]
    assert [s.virtual_stage(r, 1) for r in range(p)] == [7, 6, 5, 4]
    # Rank p-1 passes chunk 0's output to its own chunk 1: no message to itself.
    assert not any(a.peer == p - 1 for a in s.ranks[p - 1] if not a.is_compute)
    # The loss (stage 2p-1) and the input (stage 0) both live on rank 0.
    assert s.virtual_stage(0, 1) == 2 * p - 1


def test_zb_v_turn_order_is_checked_by_the_validator():
    # Rank 0 alone with two chunks: F of chunk 1 before F of chunk 0 breaks the local data flow.
    A = sched.Action
    bad = [[A("F", 0, 1), A("F", 0, 0), A("I", 0, 1), A("I", 0, 0), A("W", 0, 0), A("W", 0, 1)]]
    s = sched.Schedule("zb-v", 1, 1, 2, bad)
    assert any("same rank" in problem for problem in sched.problems(s))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("zb-v", 4, 7, 2), "at least twice as many microbatches"),
        (("zb-v", 2, 8, 1), "exactly 2 model chunks"),
        (("zb-h1", 2, 8, 2), "one model chunk per rank"),
    ],
)
def test_bad_arguments_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        sched.build(*args)
