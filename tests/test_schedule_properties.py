"""Property tests of the schedules against theory: for every kind and shape, the schedule is
valid, never deadlocks, and with free communication its bubble is exactly (p-1)/m, or
(p-1)/(v*m) interleaved, whatever the forward/backward cost ratio."""

import math

from hypothesis import given
from hypothesis import strategies as st

from megart import schedule as sched


@st.composite
def shapes(draw):
    # The zero-bubble kinds have their own theory (tests/test_schedule_zero_bubble.py).
    kind = draw(st.sampled_from(("gpipe", "1f1b", "interleaved")))
    if kind == "interleaved":
        p = draw(st.integers(2, 16))
        m = p * draw(st.integers(1, 64 // p))
        v = draw(st.integers(1, 4))
    else:
        p = draw(st.integers(1, 16))
        m = draw(st.integers(1, 64))
        v = 1
    return kind, p, m, v


costs = st.tuples(st.integers(1, 5), st.integers(1, 5))  # (t_f, t_b) in whole units


@given(shapes(), costs)
def test_bubble_equals_theory_with_free_communication(shape, cost):
    kind, p, m, v = shape
    t_f, t_b = cost
    s = sched.build(kind, p, m, v)
    assert sched.problems(s) == []
    # Costs are per microbatch through a rank's whole share; v divides them exactly.
    sim = sched.simulate(s, forward_time=t_f * v, backward_time=t_b * v)
    assert sim.ideal == m * v * (t_f + t_b)
    assert math.isclose(sim.bubble_fraction, sched.theoretical_bubble(kind, p, m, v), rel_tol=1e-12)


@given(shapes(), st.integers(1, 5))
def test_forward_only_pass_keeps_the_forwards_and_fills_and_drains_once(shape, t_f):
    kind, p, m, v = shape
    full = sched.build(kind, p, m, v)
    f = sched.forward_only(full)
    assert f.forward_only and sched.problems(f) == []
    for mine, theirs in zip(f.ranks, full.ranks, strict=True):
        assert mine == [a for a in theirs if a.op in ("F", "SEND_F", "RECV_F")]
    sim = sched.simulate(f, forward_time=t_f * v)
    assert sim.ideal == m * v * t_f
    # Only the forwards' fill and drain: (p-1)/m, or (p-1)/(v*m) interleaved.
    assert math.isclose(sim.bubble_fraction, (p - 1) / (m * v), rel_tol=1e-12)
    assert all(r.peak_stashed == min(1, m) for r in sim.ranks)


@given(shapes())
def test_bubble_with_backward_twice_forward(shape):
    kind, p, m, v = shape
    sim = sched.simulate(sched.build(kind, p, m, v), forward_time=v, backward_time=2 * v)
    # Makespan = ideal + (p-1)(t_f+t_b)/v: the fill and drain of the pipeline.
    assert math.isclose(sim.makespan, m * v * 3 + (p - 1) * 3, rel_tol=1e-12)


@given(st.integers(1, 16), st.integers(1, 64))
def test_one_f_one_b_holds_at_most_p_microbatches_and_gpipe_holds_m(p, m):
    one = sched.simulate(sched.build("1f1b", p, m))
    assert [r.peak_stashed for r in one.ranks] == [min(m, p - r) for r in range(p)]
    gpipe = sched.simulate(sched.build("gpipe", p, m))
    assert [r.peak_stashed for r in gpipe.ranks] == [m] * p


@given(shapes(), st.floats(0.01, 2.0), st.floats(0.0, 2.0))
def test_communication_costs_never_deadlock_and_only_add_time(shape, latency, wire):
    kind, p, m, v = shape
    s = sched.build(kind, p, m, v)
    free = sched.simulate(s)
    slow = sched.simulate(s, latency=latency, bandwidth=1.0, message_bytes=wire)
    assert slow.makespan >= free.makespan
    assert slow.ideal == free.ideal
    if p > 1:
        assert slow.makespan > free.makespan


@given(shapes())
def test_every_rank_sends_and_receives_in_matching_order(shape):
    kind, p, m, v = shape
    s = sched.build(kind, p, m, v)
    for src in range(p):
        for dst in range(p):
            sends = [a for a in s.ranks[src] if a.op.startswith("SEND") and a.peer == dst]
            recvs = [a for a in s.ranks[dst] if a.op.startswith("RECV") and a.peer == src]
            assert len(sends) == len(recvs)
            for tx, rx in zip(sends, recvs, strict=True):
                assert tx.op[-1] == rx.op[-1] and tx.mb == rx.mb


@given(shapes())
def test_receives_come_before_their_consumer_and_ahead_of_the_previous_compute(shape):
    kind, p, m, v = shape
    s = sched.build(kind, p, m, v)
    for actions in s.ranks:
        computes = [i for i, a in enumerate(actions) if a.is_compute]
        for i, a in enumerate(actions):
            if not a.op.startswith("RECV"):
                continue
            wanted = "F" if a.op == "RECV_F" else "B"
            consumer = next(
                j
                for j in computes
                if actions[j].op == wanted and (actions[j].mb, actions[j].chunk) == (a.mb, a.chunk)
            )
            earlier = [j for j in computes if j < consumer]
            # Posted before the compute that precedes its consumer, so the transfer overlaps it.
            assert i < consumer
            if earlier:
                assert i < earlier[-1]
