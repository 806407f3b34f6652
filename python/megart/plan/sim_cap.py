"""The simulated pipeline at a large microbatch count m without simulating m microbatches.

The simulator runs every microbatch, so a plan at m in the hundreds of thousands spent minutes in
it. Past their warm-up, the built-in schedules repeat: every rank runs the same computes and
messages per microbatch, and each time is a maximum of earlier times plus costs, so the timeline
becomes periodic, the state after microbatch k + c that after k shifted by a constant (max-plus
linear systems are eventually periodic). The period c is not always 1: a pipeline whose round trip
outlasts its slowest stage (any message latency on equal stages under 1F1B) is limited by a rank's
window of p - r microbatches in flight, and repeats every p - r microbatches. So:

- one simulation at a probe count m_p finds c and the shift from the timeline itself: every
  rank's compute and message times, over the second half of its steady part, must be those c
  microbatches earlier plus one shift (to rounding);
- m2 >= m_p is the count congruent to m modulo c, m1 = m2 - c; both are simulated, and since
  the makespan then grows by the same amount every c microbatches, the makespan at m is
  T(m2) + (m - m2) / c x (T(m2) - T(m1)), checked against the probe's shift;
- the peak held pairs are m2's (the holdings stop growing after the warm-up), and the bubble is
  the simulator's (makespan - ideal) / ideal with the ideal (the busiest rank's compute, m times
  a microbatch's) scaled from m2 to m.

Where no period shows (a transient still running at the probe, a period above 2p) in the probe
or in shorter ones, m is simulated. tests/test_plan_sim_cap.py compares the capped results with
the full ones.

With megart's runtime (``posted``) the timeline is periodic too since the posting plan groups
messages whose starts are equal to rounding (cpp/schedule/post_plan.cpp); grouping by exactly
equal starts split groups at random microbatches of long schedules (one planner case at zb-h1,
p = 2, gave 2.91e-5 to 3.13e-5 s per microbatch between m = 256 and 6250), which no
extrapolation reproduces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megart import schedule as sched

# The schedules megart plan uses (gpipe holds all m microbatches: its peak never saturates).
CAPPED_KINDS = ("1f1b", "interleaved", "zb-h1", "zb-v")
# The probe: 32 p microbatches (at least 256), so that its second half, less the cool-down, spans
# several periods of up to 2p after transients seen up to 12p long (zb-v, p = 16).
PROBE_MIN, PROBE_PER_STAGE = 256, 32
# The shortest probe tried when longer ones show no period.
PROBE_MIN_LAST = 64
# Capped only above four probes' worth: three simulations near m_p then cost less than one of m.
CAP_FACTOR = 4
# Times equal to rounding: relative to the probe's makespan.
REL_TOL = 1e-11


@dataclass(frozen=True)
class Capped:
    """The simulated makespan, bubble fraction and peak pairs per rank at m, and the largest
    count simulated for them (m2: its schedule holds what m's does)."""

    makespan: float
    bubble: float
    peaks: list[int]
    simulated_m: int


def step_of(kind: str, p: int) -> int:
    """The microbatch counts the schedule takes come in multiples of this."""
    return p if kind == "interleaved" else 1


def probe_count(kind: str, p: int) -> int:
    """m_p: a multiple of the schedule's step."""
    step = step_of(kind, p)
    want = max(PROBE_MIN, PROBE_PER_STAGE * p)
    return -(-want // step) * step


def caps(kind: str, p: int, m: int) -> bool:
    """Whether m is capped: a kind whose holdings saturate, m above CAP_FACTOR probes."""
    return p > 1 and kind in CAPPED_KINDS and m > CAP_FACTOR * probe_count(kind, p)


def _times(sim: sched.Simulation, m: int) -> list[tuple[list[float], int]]:
    """Each rank's compute ends and message starts and ends, with how many of each a
    microbatch adds (None where a count is not a multiple of m)."""
    out = []
    for tl in sim.ranks:
        compute = [s.end for s in tl.compute]
        comm = tl.communication
        for times in (compute, [s.start for s in comm], [s.end for s in comm]):
            if len(times) % m:
                return []
            out.append((times, len(times) // m))
    return out


def period(sim: sched.Simulation, kind: str, p: int, m: int) -> tuple[int, float] | None:
    """(c, shift): the smallest c (a multiple of the step, at most 2p) such that every time of
    the second half of the steady part of ``sim`` (m microbatches) is the time c microbatches
    earlier plus one shift; None if there is none."""
    times = _times(sim, m)
    if not times:
        return None
    tol = REL_TOL * sim.makespan
    step = step_of(kind, p)
    lo, hi = m // 2, m - 3 * p  # past warm-up and transients, before the cool-down
    for c in range(step, 2 * p + 1, step):
        if hi - lo < 3 * c + p:
            break
        shift = times[0][0][(lo + c) * times[0][1]] - times[0][0][lo * times[0][1]]
        if shift > 0 and all(
            abs(ts[i + c * a] - ts[i] - shift) <= tol
            for ts, a in times
            for i in range(lo * a, (hi - c) * a)
        ):
            return c, shift
    return None


def capped(
    kind: str, p: int, m: int, run: Callable[[int], sched.Simulation], m_p: int | None = None
) -> Capped | None:
    """The simulated results at m from simulations (``run(count)``) of at most m_p + 2p
    microbatches (m_p: probe_count by default; a multiple of the step, at most m); None where
    no period shows (simulate m itself)."""
    m_p = m_p or probe_count(kind, p)
    step = step_of(kind, p)
    # Halved while no period shows (a transient still running at the probe).
    while True:
        probe = run(m_p)
        found = period(probe, kind, p, m_p)
        if found is not None:
            break
        m_p = m_p // 2 // step * step
        if m_p < max(PROBE_MIN_LAST, 16 * p):
            return None
    c, shift = found
    m2 = m_p + (m - m_p) % c
    m1 = m2 - c
    sim2 = probe if m2 == m_p else run(m2)
    sim1 = run(m1)
    grown = sim2.makespan - sim1.makespan
    if abs(grown - shift) > REL_TOL * sim2.makespan:
        return None
    makespan = sim2.makespan + (m - m2) // c * grown
    ideal = sim2.ideal * m / m2
    bubble = (makespan - ideal) / ideal if ideal > 0 else 0.0
    return Capped(makespan, bubble, [r.peak_stashed for r in sim2.ranks], m2)
