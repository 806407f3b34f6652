"""Schedules and simulations as plain data (for JSON) and as a printed table."""

from __future__ import annotations

from typing import Any

from megart._core import schedule as _s


def action_dict(action: _s.Action) -> dict[str, Any]:
    out: dict[str, Any] = {"op": action.op, "mb": action.mb, "chunk": action.chunk}
    if not action.is_compute:
        out["peer"] = action.peer
    return out


def to_dict(schedule: _s.Schedule, simulation: _s.Simulation | None = None) -> dict[str, Any]:
    """The schedule as JSON-ready data: ``ranks`` holds each rank's actions as
    ``{"op", "mb", "chunk"}`` (plus ``"peer"`` on communication); with a simulation, also the
    makespan, the bubble beside theory, each rank's peak in-flight (microbatch, chunk)
    activations and its compute timeline."""
    out: dict[str, Any] = {
        "kind": schedule.kind,
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "chunks": schedule.chunks,
        "ranks": [[action_dict(a) for a in actions] for actions in schedule.ranks],
    }
    if simulation is not None:
        out["makespan"] = simulation.makespan
        out["ideal"] = simulation.ideal
        out["bubble_fraction"] = simulation.bubble_fraction
        if schedule.kind != "custom":
            out["theoretical_bubble"] = _s.theoretical_bubble(
                schedule.kind, schedule.stages, schedule.microbatches, schedule.chunks
            )
        out["peak_in_flight"] = [r.peak_stashed for r in simulation.ranks]
        out["timelines"] = [
            [
                {**action_dict(span.action), "start": span.start, "end": span.end}
                for span in r.compute
            ]
            for r in simulation.ranks
        ]
    return out


def table(rows: list[tuple[_s.Schedule, _s.Simulation]]) -> str:
    """One line per schedule: simulated bubble beside theory, makespan, peak in-flight."""
    header = (
        f"{'kind':<12}{'p':>4}{'m':>5}{'v':>4}{'bubble':>10}{'theory':>10}"
        f"{'makespan':>11}{'ideal':>9}   peak in-flight per rank"
    )
    lines = [header, "-" * len(header)]
    for s, sim in rows:
        theory = _s.theoretical_bubble(s.kind, s.stages, s.microbatches, s.chunks)
        peaks = " ".join(str(r.peak_stashed) for r in sim.ranks)
        lines.append(
            f"{s.kind:<12}{s.stages:>4}{s.microbatches:>5}{s.chunks:>4}"
            f"{sim.bubble_fraction:>10.4f}{theory:>10.4f}{sim.makespan:>11.3f}{sim.ideal:>9.3f}"
            f"   {peaks}"
        )
    return "\n".join(lines)
