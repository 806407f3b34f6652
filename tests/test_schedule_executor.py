"""Driving the per-rank state machines step by step, as the pipeline engine will: an executor
written here in Python, independent of the C++ simulator, runs every rank to completion."""

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megart import DeadlockError, ScheduleError
from megart import schedule as sched


def run_all(schedule, order):
    """Runs all ranks, taking them in `order` each round; a message moves once both sides have
    posted it. Returns each rank's compute order as executed; raises on a stall."""
    machines = [sched.RankStateMachine(schedule, r) for r in range(schedule.stages)]
    posted = {}  # (src, dst) -> (deque of sends, deque of recvs)
    executed = [[] for _ in machines]
    while not all(m.done() for m in machines):
        progressed = False
        for r in order:
            m = machines[r]
            while m.ready():
                a = m.issue()
                progressed = True
                if a.is_compute:
                    m.complete(a)  # compute finishes at once here
                    executed[r].append((a.op, a.mb, a.chunk))
                    continue
                key = (r, a.peer) if a.op.startswith("SEND") else (a.peer, r)
                sends, recvs = posted.setdefault(key, (deque(), deque()))
                (sends if a.op.startswith("SEND") else recvs).append(a)
                while sends and recvs:
                    tx, rx = sends.popleft(), recvs.popleft()
                    assert (tx.op[-1], tx.mb) == (rx.op[-1], rx.mb)
                    machines[key[0]].complete(tx)
                    machines[key[1]].complete(rx)
        if not progressed:
            raise AssertionError(
                "stalled: "
                + "; ".join(
                    f"rank {m.rank} at {m.next()} waiting for {m.blocker()}"
                    for m in machines
                    if m.has_next()
                )
            )
    return executed, machines


@given(
    st.sampled_from([("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]),
    st.integers(2, 6),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_python_executor_runs_every_schedule_to_completion(kind_chunks, p, rounds, rng):
    kind, v = kind_chunks
    m = p * rounds
    s = sched.build(kind, p, m, v)
    order = list(range(p))
    rng.shuffle(order)
    executed, machines = run_all(s, order)
    for r, done in enumerate(executed):
        assert done == [(a.op, a.mb, a.chunk) for a in s.ranks[r] if a.is_compute]
        assert machines[r].stashed == 0
        assert machines[r].peak_stashed == sched.simulate(s).ranks[r].peak_stashed


def test_state_machine_refuses_out_of_order_use():
    s = sched.build("1f1b", 2, 2)
    m = sched.RankStateMachine(s, 0)
    f = m.issue()
    assert f == sched.Action("F", 0, 0)
    assert m.blocker() == f  # SEND_F waits for its forward
    with pytest.raises(ScheduleError, match="waits for F"):
        m.issue()
    m.complete(f)
    assert m.issue() == sched.Action("SEND_F", 0, 0, peer=1)
    with pytest.raises(ScheduleError, match="before it was issued"):
        m.complete(sched.Action("B", 1, 0))


def test_deadlock_names_the_blocked_ranks_and_what_they_wait_for():
    f = [sched.Action("F", mb) for mb in range(2)]
    b = [sched.Action("B", mb) for mb in range(2)]
    s = sched.from_compute_orders([[f[0], b[0], f[1], b[1]], [f[0], f[1], b[0], b[1]]], 2)
    assert sched.problems(s) == []  # every rule holds, yet the data flow is a cycle
    with pytest.raises(DeadlockError) as e:
        sched.simulate(s)
    msg = str(e.value)
    assert "rank 0 is blocked at B(mb=0, chunk=0), waiting for RECV_B(mb=0, chunk=0, peer=1)" in msg
    assert "rank 1 is blocked at F(mb=1, chunk=0), waiting for RECV_F(mb=1, chunk=0, peer=0)" in msg
    with pytest.raises(AssertionError, match="stalled"):
        run_all(s, [0, 1])
