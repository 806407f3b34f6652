"""The pipeline part of a layout's iteration (megart.plan.estimate): the schedule's makespan,
bubble and microbatches held at each rank's peak, by megart's schedule simulator (or theory
where the schedule has a closed form), with the stage's costs and its messages over NVLink or a
rail."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from megart import schedule as sched
from megart.models import GPTConfig
from megart.plan import sim_cap
from megart.plan.hardware import GPUProfile
from megart.plan.holding import State, states, theory_in_flight
from megart.plan.layout import ZERO_BUBBLE, Layout
from megart.plan.timing import Work
from megart.training.config import TrainConfig
from megart.training.pipeline_costs import plan_costs


# A search builds the same few schedules for thousands of layouts: each once (they are never
# changed once built), with what its ranks hold after each compute.
@functools.lru_cache(maxsize=64)
def schedule_of(kind: str, p: int, m: int, v: int) -> sched.Schedule:
    return sched.build(kind, p, m, v)


@functools.lru_cache(maxsize=64)
def states_of(kind: str, p: int, m: int, v: int) -> list[list[State]]:
    return states(schedule_of(kind, p, m, v))


@functools.lru_cache(maxsize=1024)
def _simulated(
    shape: tuple[str, int, int, int],
    forward: float,
    backward: float,
    latency: float,
    bandwidth: float,
    message: float,
    weight_fraction: float,
    posted: bool,
    stage_forward: tuple[float, ...],
    stage_backward: tuple[float, ...],
    planned_for: tuple[float, float, float, float] | None = None,
) -> tuple[float, float, list[int], int]:
    """The simulator's makespan, bubble fraction and peak pairs per rank of the schedule of
    ``shape`` (kind, p, m, v) with these costs, and the microbatches of the longest schedule
    simulated: m, or above sim_cap's threshold fewer, from which m's results follow exactly
    (megart.plan.sim_cap). Layouts that differ in what the schedule does not see (the
    distributed optimizer) simulate once. ``planned_for`` (with ``posted``): the relative
    forward, backward, weight fraction and message latency the posting plan is made for
    (None: these costs)."""
    planned = None
    if posted and planned_for is not None:
        forward_share, backward_share, fraction, message_share = planned_for
        planned = sched.Costs(
            forward=forward_share,
            backward=backward_share,
            weight_fraction=fraction,
            latency=message_share,
        )
    kind, p, m, v = shape

    def run(count: int) -> sched.Simulation:
        return sched.simulate(
            schedule_of(kind, p, count, v),
            forward,
            backward,
            latency=latency,
            bandwidth=bandwidth,
            message_bytes=message,
            weight_fraction=weight_fraction,
            posted=posted,
            stage_forward=list(stage_forward),
            stage_backward=list(stage_backward),
            planned_for=planned,
        )

    if sim_cap.caps(kind, p, m):
        got = sim_cap.capped(kind, p, m, run)
        if got is not None:
            return got.makespan, got.bubble, got.peaks, got.simulated_m
    sim = run(m)
    return sim.makespan, sim.bubble_fraction, [r.peak_stashed for r in sim.ranks], m


def _runtime_plan_costs(c: TrainConfig) -> tuple[float, float, float, float]:
    """The costs megart train's posting plan is made for (training.pipeline_costs.plan_costs:
    fixed ratios, as the runtime cannot measure its layers and links before it runs), so that
    the plan simulated is the plan run, timed with the predicted costs."""
    k = plan_costs(c)
    return k.forward, k.backward, k.weight_fraction, k.latency


@dataclass
class PipelineRun:
    """One iteration's schedule on the slowest stage."""

    stage: Work  # one microbatch through it, blocking exchanges included
    makespan: float
    bubble: float
    compute_only: float  # m x (forward + backward), without blocking exchanges
    in_flight: list[int]  # per rank, (microbatch, chunk) pairs held at its peak
    # The simulated schedule, where one was simulated: above sim_cap's threshold one of fewer
    # microbatches than m, whose holdings (peaks, states_of) are m's; nothing draws or prints it.
    plan: sched.Schedule | None = None
    stages: list[Work] = field(default_factory=list)  # uneven stages: each rank's, as run


def pipeline_run(
    c: TrainConfig,
    cfg: GPTConfig,
    layout: Layout,
    dp: int,
    gpu: GPUProfile,
    stage: Work,
    residual_bytes: int,
    m: int,
    simulate: bool,
    pp_overlap: bool,
    runtime: str,
    stages: list[Work] | None = None,
) -> PipelineRun:
    """The schedule's makespan and bubble with ``stage``'s costs, by megart's simulator (or
    theory when ``simulate`` is False and the schedule has a closed form), its messages over
    NVLink or a rail. megart's runtime is timed as it runs: the NCCL groups of its posting plan,
    made as megart train makes it (for plan_costs' fixed ratios, not the predicted costs).
    ``stages`` (uneven stages): each rank's costs, ``stage`` the slowest of them; always
    simulated (the bubble has no closed form for unequal stages)."""
    stages = list(stages or [])
    t, p, v, b, sp = layout.sizes()
    # Pipeline messages: the residual stream of this rank's s/cp tokens, 1/t of it with
    # scatter/gather or sequence parallelism; over a rail when consecutive stages sit on
    # different nodes (t x cp x d ranks apart).
    scatter = sp or c.scatter_gather_tensors_in_pipeline
    tokens = cfg.seq_length // layout.cp * b
    message = tokens * cfg.hidden_size * residual_bytes / (t if scatter else 1)
    cross_node = t * layout.cp * dp >= gpu.gpus_per_node
    link_bw = (gpu.rail_gb_per_s if cross_node else gpu.nvlink_bus_gb_per_s) * 1e9
    latency = gpu.link_latency_us * 1e-6
    if scatter and t > 1 and not sp:  # the receiver's all-gather over NVLink
        latency += message * (t - 1) / (gpu.nvlink_bus_gb_per_s * 1e9)
    kind = layout.kind
    blocking = 0.0
    if p > 1 and not pp_overlap:
        # Sends and receives of one step go out together (full duplex): one message's time,
        # spent by the rank instead of computing; the simulator's messages are then free.
        blocking = v * (latency + message / link_bw)
        stage = stage + Work(blocking, blocking, 0.0)
        stages = [w + Work(blocking, blocking, 0.0) for w in stages]
        latency, message = 0.0, 0.0
    zero_bubble = p > 1 and kind in ZERO_BUBBLE
    plan = None
    if p > 1 and (simulate or zero_bubble or stages):
        # Zero-bubble schedules are always simulated: their bubble has a closed form only
        # with equal F, I and W times.
        makespan, bubble, peak, simulated_m = _simulated(
            (kind, p, m, v),
            stage.forward,
            stage.backward,
            latency,
            link_bw,
            message,
            stage.weight / stage.backward if zero_bubble else 0.5,
            runtime == "megart",
            tuple(w.forward for w in stages),
            tuple(w.backward for w in stages),
            _runtime_plan_costs(c) if runtime == "megart" else None,
        )
        in_flight = list(peak)  # the cached list stays as simulated
        plan = schedule_of(kind, p, simulated_m, v)
    else:
        work = m * (stage.forward + stage.backward)
        bubble = sched.theoretical_bubble(kind, p, m, v) if p > 1 else 0.0
        hops = 2 * (p - 1) * (latency + message / link_bw) if p > 1 else 0.0
        makespan = work * (1 + bubble) + hops
        in_flight = theory_in_flight(p, m, v)
    # Blocking exchanges count as pipeline communication, with their share of the bubble.
    compute_only = m * (stage.forward + stage.backward - 2 * blocking)
    return PipelineRun(stage, makespan, bubble, compute_only, in_flight, plan, stages)
