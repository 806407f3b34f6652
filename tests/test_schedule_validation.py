"""The validator catches each kind of broken schedule, with a message naming it."""

import pytest

from megart import ConfigError, ScheduleError
from megart import schedule as sched


def edited(kind, p, m, v, rank, edit):
    s = sched.build(kind, p, m, v)
    ranks = [list(r) for r in s.ranks]
    edit(ranks[rank])
    return sched.Schedule(kind, p, m, v, ranks)


def test_built_schedules_are_valid():
    for kind, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]:
        sched.validate(sched.build(kind, 4, 8, v))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.remove(sched.Action("B", 3)), r"no backward for \(mb=3, chunk=0\)"),
        (lambda r: r.append(sched.Action("F", 3)), r"F\(mb=3, chunk=0\) appears twice"),
        (lambda r: r.insert(0, r.pop(r.index(sched.Action("B", 0)))), "comes before its F"),
        (lambda r: r.remove(sched.Action("RECV_F", 2, 0, 0)), r"has no RECV_F\(mb=2"),
        (lambda r: r.append(sched.Action("F", 9)), "out of range"),
        (
            lambda r: r.__setitem__(
                r.index(sched.Action("SEND_B", 1, 0, 0)), sched.Action("SEND_B", 1, 0, 2)
            ),
            "names the wrong peer",
        ),
    ],
)
def test_broken_schedules_are_named(edit, message):
    s = edited("1f1b", 4, 4, 1, 1, edit)
    with pytest.raises(ScheduleError, match=message):
        sched.validate(s)
    assert sched.problems(s)


def test_receives_out_of_the_senders_order_are_refused():
    def swap_first_two_receives(r):
        i, j = [k for k, a in enumerate(r) if a.op == "RECV_F"][:2]
        r[i], r[j] = r[j], r[i]

    s = edited("gpipe", 2, 3, 1, 1, swap_first_two_receives)
    with pytest.raises(ScheduleError, match="receives must follow the sender's order"):
        sched.validate(s)


def test_split_backward_is_accepted_for_future_zero_bubble_kinds():
    # A 2-stage pipeline with the backward split into I (input grad) and W (weight grad).
    orders = [
        [sched.Action("F", 0), sched.Action("I", 0), sched.Action("W", 0)],
        [sched.Action("F", 0), sched.Action("I", 0), sched.Action("W", 0)],
    ]
    s = sched.from_compute_orders(orders, microbatches=1)
    assert sched.problems(s) == []
    assert [a.op for a in s.ranks[1]] == ["RECV_F", "F", "I", "SEND_B", "W"]
    sim = sched.simulate(s, forward_time=1, backward_time=2, weight_fraction=0.5)
    # F0, F1, I1, (SEND_B), I0, W0 on rank 0 finishes at 1 + 1 + 1 + 1 + 1.
    assert sim.makespan == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (("interleaved", 4, 6, 2), r"multiple of the pipeline size \(4\); use 4 or 8"),
        (("interleaved", 1, 4, 2), "at least 2 pipeline stages"),
        (("1f1b", 4, 8, 2), "use the interleaved schedule"),
        (("gpipe", 4, 0, 1), "at least 1"),
        (("pipedream", 4, 8, 1), "unknown schedule kind"),
    ],
)
def test_bad_arguments_raise_config_error_saying_what_fits(args, message):
    with pytest.raises(ConfigError, match=message):
        sched.build(*args)
    with pytest.raises(ValueError):  # ConfigError is also a ValueError
        sched.build(*args)
