"""Timing the posting plan as NCCL runs it (``simulate(..., posted=True)``) against a model
written here, apart from the C++ simulator: a rank's groups run one after another, each after
the computes posted before it; a message moves once both its groups have started and its link
is free; a group ends with its last message; a compute waits for the group bringing its input.

With free communication the plan must keep the schedule's bubble exactly (the first, round-based
plan lost up to a quarter of an interleaved iteration at p = 8, which this checks against), and
a plan made for costly messages must run as the schedule as written where they cost what it
was made for (a plan made for free messages lost up to a tenth of an iteration there).
"""

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megart import ConfigError
from megart import schedule as sched

KINDS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-v": 2}


def build(kind, p, extra, forward_only):
    m = p * (1 + extra // 3) if kind == "interleaved" else p + extra
    if kind == "zb-v":
        m += p
    s = sched.build(kind, p, m, KINDS[kind])
    return sched.forward_only(s) if forward_only else s


def cost(s, a, forward=1.0, backward=2.0):
    v = s.chunks
    return {"F": forward / v, "B": backward / v, "I": backward / 2 / v, "W": backward / 2 / v}[a.op]


def input_recv(s, r, a):
    """(F or B, mb, chunk) of the message compute ``a`` of rank r waits for, or None."""
    stage, last = s.virtual_stage(r, a.chunk), s.stages * s.chunks - 1
    if a.op == "F" and stage > 0:
        neighbour, kind = stage - 1, "F"
    elif a.op in ("B", "I") and stage < last:
        neighbour, kind = stage + 1, "B"
    else:
        return None
    if any(s.virtual_stage(r, c) == neighbour for c in range(s.chunks)):
        return None  # a hand-over on the same rank
    return (kind, a.mb, a.chunk)


def model_makespan(s, latency):
    """The last event's time when every rank follows its posting plan (made, as simulate's
    posted timing makes it, for these costs)."""
    plan = sched.post_plan(s, sched.Costs(latency=latency))
    p = s.stages
    computes = [[x.compute for x in plan[r] if x.compute is not None] for r in range(p)]
    groups = []  # (rank, computes before, ops)
    for r in range(p):
        before = 0
        for x in plan[r]:
            if x.compute is not None:
                before += 1
            else:
                groups.append((r, before, list(x.post)))
    of_rank = defaultdict(list)
    sends, recvs, carries = defaultdict(list), defaultdict(list), {}
    for g, (r, _, ops) in enumerate(groups):
        of_rank[r].append(g)
        for a in ops:
            if a.op.startswith("SEND"):
                sends[(r, a.peer)].append(g)
            else:
                recvs[(a.peer, r)].append(g)
                carries[(r, a.op[-1], a.mb, a.chunk)] = g
    links = {d: list(zip(sends[d], recvs[d], strict=True)) for d in sends}
    start, end, message_end = {}, {}, {}
    done = [[None] * len(c) for c in computes]
    changed = True
    while changed:
        changed = False
        for r in range(p):
            for i, g in enumerate(of_rank[r]):
                before = groups[g][1]
                if g not in start:
                    ready = done[r][before - 1] if before else 0.0
                    previous = end.get(of_rank[r][i - 1]) if i else 0.0
                    if ready is None or previous is None:
                        break
                    start[g], changed = max(ready, previous), True
                mine = [t for t, pair in message_end.items() if g in pair[0]]
                count = sum(1 for pairs in links.values() for pair in pairs if g in pair)
                if g not in end:
                    if len(mine) < count:
                        break
                    end[g] = max([start[g]] + [message_end[t][1] for t in mine])
                    changed = True
            for k, a in enumerate(computes[r]):
                if done[r][k] is not None:
                    continue
                begin = done[r][k - 1] if k else 0.0
                need = input_recv(s, r, a)
                arrived = end.get(carries[(r, *need)]) if need else 0.0
                if begin is None or arrived is None:
                    break
                done[r][k], changed = max(begin, arrived) + cost(s, a), True
        for d, pairs in links.items():
            for k, (tx, rx) in enumerate(pairs):
                if (d, k) in message_end:
                    continue
                free = message_end[(d, k - 1)][1] if k else 0.0
                if tx not in start or rx not in start:
                    break
                message_end[(d, k)] = ((tx, rx), max(start[tx], start[rx], free) + latency)
                changed = True
    assert all(x is not None for row in done for x in row), "the model stalled"
    return max([max(row) for row in done if row] + list(end.values()))


SCHEDULES = st.builds(
    build, st.sampled_from(sorted(KINDS)), st.integers(2, 8), st.integers(0, 12), st.booleans()
)


@settings(max_examples=40, deadline=None)
@given(s=SCHEDULES, latency=st.sampled_from([0.0, 0.05, 0.3]))
def test_posted_timing_matches_an_independent_model_of_nccl_groups(s, latency):
    sim = sched.simulate(s, latency=latency, posted=True)
    assert abs(sim.makespan - model_makespan(s, latency)) < 1e-9


@settings(max_examples=60, deadline=None)
@given(
    s=SCHEDULES,
    forward=st.sampled_from([1.0, 0.7, 2.5]),
    backward=st.sampled_from([2.0, 1.1, 3.0]),
    weight_fraction=st.sampled_from([0.5, 0.2, 0.8]),
)
def test_the_plan_keeps_the_schedules_bubble_for_the_costs_it_was_made_for(
    s, forward, backward, weight_fraction
):
    """With free communication, a plan made for the computes' costs (simulate's posted timing
    makes it so) starts every message when the schedule as written would."""
    costs = dict(forward_time=forward, backward_time=backward, weight_fraction=weight_fraction)
    as_written = sched.simulate(s, **costs)
    posted = sched.simulate(s, posted=True, **costs)
    assert abs(posted.makespan - as_written.makespan) < 1e-9
    assert [r.peak_stashed for r in posted.ranks] == [r.peak_stashed for r in as_written.ranks]


def test_a_plan_needs_computes_that_take_time():
    s = sched.build("zb-h1", 2, 4)
    with pytest.raises(ConfigError, match="weight_fraction strictly between 0 and 1"):
        sched.post_plan(s, sched.Costs(weight_fraction=0.0))


def test_interleaved_at_p8_keeps_its_theoretical_bubble():
    """Where the round-based plan posted each send with its rank's later messages: 0.375 of
    the ideal time instead of (p - 1) / (v m) = 0.109."""
    s = sched.build("interleaved", 8, 32, 2)
    bubble = sched.simulate(s, posted=True).bubble_fraction
    assert abs(bubble - sched.theoretical_bubble("interleaved", 8, 32, 2)) < 1e-9


GRID = [
    (kind, p, p * per_stage, v)
    for kind, v in [*KINDS.items(), ("interleaved", 4)]
    for p in (2, 4, 8)
    for per_stage in ((2, 4) if kind == "zb-v" else (1, 2, 4))
]


@pytest.mark.parametrize("share", [0.05, 0.2])
def test_a_plan_made_for_its_messages_costs_runs_as_the_schedule_is_written(share):
    """Each message a ``share`` of a chunk's forward; the schedule as written overlaps its
    messages freely, which NCCL's one-group-at-a-time does not, so only the right grouping
    gets there (a plan made for free messages took up to 1.104 times as long at 0.2)."""
    for kind, p, m, v in GRID:
        s = sched.build(kind, p, m, v)
        costs = dict(latency=share / v)
        as_written = sched.simulate(s, **costs).makespan
        posted = sched.simulate(s, posted=True, **costs).makespan
        assert abs(posted - as_written) < 1e-9 * as_written, (kind, p, m, v)


@settings(max_examples=60, deadline=None)
@given(
    s=SCHEDULES,
    backward=st.sampled_from([2.0, 1.1, 3.0]),
    weight_fraction=st.sampled_from([0.5, 0.2, 0.8]),
    share=st.floats(0.01, 0.9),
)
def test_a_plan_made_for_costly_messages_keeps_the_bubble_when_they_are_free(
    s, backward, weight_fraction, share
):
    """What the trainer relies on when it plans for messages it cannot yet time (a fifth of a
    chunk's forward): guessing them costly costs nothing where they turn out free, for every
    kind but zb-v, whose plan lost up to 3.5% in bench/pipeline_plan.py's random cases (bounded
    here at 5%). Not up to a whole chunk's forward: at exactly that, messages of different
    steps start together and share a group, and an interleaved forward-only pass at p = 4,
    m = 4 took 1.154 times as long (found here by hypothesis; a grid of shares 0.01-1.0 found
    no other case)."""
    free = dict(backward_time=backward, weight_fraction=weight_fraction)
    planned = sched.Costs(
        backward=backward, weight_fraction=weight_fraction, latency=share / s.chunks
    )
    as_written = sched.simulate(s, **free).makespan
    posted = sched.simulate(s, posted=True, planned_for=planned, **free).makespan
    bound = 1.05 if s.kind == "zb-v" else 1.0 + 1e-9
    assert as_written - 1e-9 <= posted <= bound * as_written


def test_planned_for_times_only_a_posting_plan():
    with pytest.raises(ConfigError, match="pass posted=True"):
        sched.simulate(sched.build("1f1b", 2, 2), planned_for=sched.Costs())


def test_costs_as_one_object_time_as_the_numbers_do():
    s = sched.build("interleaved", 4, 8, 2)
    numbers = dict(forward_time=1.5, backward_time=2.5, weight_fraction=0.4, latency=0.05)
    numbers.update(bandwidth=10.0, message_bytes=2.0)
    costs = sched.Costs(
        forward=1.5, backward=2.5, weight_fraction=0.4, latency=0.05, bandwidth=10.0,
        message_bytes=2.0,
    )  # fmt: skip
    for posted in (False, True):
        by_numbers = sched.simulate(s, posted=posted, **numbers)
        assert sched.simulate(s, posted=posted, costs=costs).makespan == by_numbers.makespan
    with pytest.raises(ConfigError, match="either as a Costs or as numbers"):
        sched.simulate(s, latency=0.1, costs=costs)
