"""Pipeline schedules as data: build, validate, simulate and draw them.

A schedule gives each pipeline rank an ordered list of actions for one iteration: compute
(``F``, ``B``; ``I`` and ``W`` for split backwards) on a (microbatch, chunk), and communication
(``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``) with a peer rank. The C++ core builds and checks
them; this module is the typed front door.

>>> s = build("1f1b", stages=4, microbatches=8)
>>> sim = simulate(s)
>>> round(sim.bubble_fraction, 6) == theoretical_bubble("1f1b", 4, 8)
True
"""

from __future__ import annotations

from collections.abc import Sequence

from megart._core import schedule as _s
from megart.errors import ConfigError
from megart.schedule.report import to_dict

Action = _s.Action
Schedule = _s.Schedule
Simulation = _s.Simulation
Costs = _s.Costs
RankStateMachine = _s.RankStateMachine
Step = _s.Step

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")

__all__ = [
    "KINDS",
    "Action",
    "Schedule",
    "Simulation",
    "Costs",
    "RankStateMachine",
    "Step",
    "build",
    "from_compute_orders",
    "forward_only",
    "post_plan",
    "problems",
    "validate",
    "simulate",
    "theoretical_bubble",
    "to_dict",
    "draw",
]


def build(kind: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule of a named kind (``gpipe``, ``1f1b``, ``interleaved``) for p stages, m
    microbatches and v model chunks per rank. Raises ConfigError for shapes the kind cannot
    take (interleaved needs m to be a multiple of p)."""
    return _s.build(kind, stages, microbatches, chunks)


def forward_only(schedule: Schedule) -> Schedule:
    """The evaluation pass of ``schedule`` (Megatron's forward_only): its forwards and their
    messages in the same order, with every backward and gradient message removed."""
    return _s.forward_only(schedule)


def from_compute_orders(
    orders: Sequence[Sequence[Action]], microbatches: int, chunks: int = 1, kind: str = "custom"
) -> Schedule:
    """A schedule from each rank's compute order (F/B/I/W actions), with the sends and receives
    placed the way the built-in kinds place them."""
    return _s.with_communication([list(o) for o in orders], microbatches, chunks, kind)


def post_plan(schedule: Schedule, costs: Costs | None = None) -> list[list[Step]]:
    """Every rank's posting plan: its computes in the schedule's order, and its messages in
    groups (``Step.post``) that NCCL can match, since both ranks of a pair group their messages
    alike (see cpp/schedule/post_plan.hpp). ``costs``: the expected costs of the computes and
    messages (default F = 1, B = 2, I = W = 1, messages free), the same on every rank. Raises
    DeadlockError for a schedule no blocking transport can run."""
    return _s.post_plan(schedule, costs or Costs())


def problems(schedule: Schedule) -> list[str]:
    """Every rule the schedule breaks (empty when valid)."""
    return _s.problems(schedule)


def validate(schedule: Schedule) -> None:
    """Raises ScheduleError naming the first problems, if any."""
    _s.validate(schedule)


def simulate(
    schedule: Schedule,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    latency: float = 0.0,
    bandwidth: float = 0.0,
    message_bytes: float = 0.0,
    weight_fraction: float = 0.5,
    posted: bool = False,
    planned_for: Costs | None = None,
    costs: Costs | None = None,
    stage_forward: Sequence[float] = (),
    stage_backward: Sequence[float] = (),
) -> Simulation:
    """Runs all ranks together. ``forward_time`` and ``backward_time`` are for one microbatch
    through a rank's whole share of the model (each of v chunks takes 1/v of it); each message
    costs ``latency + message_bytes / bandwidth`` (bandwidth 0: unlimited). Raises DeadlockError
    naming the blocked ranks when the schedule cannot progress.

    ``posted`` times what the pipeline engine runs: the schedule's posting plan (see
    :func:`post_plan`), with NCCL's group semantics (a rank's groups one after another, each
    with its partners' groups, after the computes posted before it), not the order as written.
    The plan is made for ``planned_for`` (by default these costs, messages included): timing a
    plan against costs it was not made for shows what a wrong guess costs.

    ``stage_forward`` and ``stage_backward`` (uneven stages): one cost per pipeline rank, rank
    r's forward and backward in place of ``forward_time`` and ``backward_time`` (empty: those on
    every rank).

    ``costs`` gives all the costs as one :class:`Costs` (as :func:`post_plan` takes them),
    instead of the float arguments."""
    given = Costs(
        forward=forward_time,
        backward=backward_time,
        weight_fraction=weight_fraction,
        latency=latency,
        bandwidth=bandwidth,
        message_bytes=message_bytes,
        stage_forward=list(stage_forward),
        stage_backward=list(stage_backward),
    )
    if costs is None:
        costs = given
    elif _fields(given) != _fields(Costs()):
        raise ConfigError("simulate: pass the costs either as a Costs or as numbers, not both")
    if posted:
        return _s.simulate_plan(schedule, costs, planned_for)
    if planned_for is not None:
        raise ConfigError("simulate: planned_for times a posting plan; pass posted=True with it")
    return _s.simulate(schedule, costs)


def _fields(c: Costs) -> tuple:
    return (
        c.forward,
        c.backward,
        c.weight_fraction,
        c.latency,
        c.bandwidth,
        c.message_bytes,
        tuple(c.stage_forward),
        tuple(c.stage_backward),
    )


def theoretical_bubble(kind: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """(p-1)/m for gpipe and 1f1b; (p-1)/(v*m) for interleaved."""
    return _s.theoretical_bubble(kind, stages, microbatches, chunks)


def draw(*args: object, **kwargs: object) -> object:
    """Draws timelines to a PNG; see :func:`megart.schedule.draw.draw`. Needs matplotlib."""
    from megart.schedule.draw import draw as _draw

    return _draw(*args, **kwargs)
