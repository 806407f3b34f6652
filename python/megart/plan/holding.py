"""What a pipeline rank holds at its peak under a schedule: (microbatch, chunk) pairs between
their forward and backward, and with zero-bubble schedules pairs between I and W, which keep
different tensors (the deferred linear layers' inputs and output gradients)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megart import schedule as sched


@dataclass(frozen=True)
class Held:
    """Counts at a rank's peak: pairs between F and their I (or B), pairs between I and W, and
    of those the pairs of the model's last virtual stage (an untied output layer's W holds the
    logits' gradient)."""

    activations: int
    weight_grads: int = 0
    last_stage_weight_grads: int = 0

    @property
    def in_flight(self) -> int:
        """Pairs held from F to W (or B): what the simulator's peak_stashed counts."""
        return self.activations + self.weight_grads


# One rank's holding after a compute: pairs between F and I (or B), pairs between I and W by
# chunk, and of those the pairs of the model's last virtual stage.
State = tuple[int, tuple[int, ...], int]


def states(schedule: sched.Schedule) -> list[list[State]]:
    """Each rank's distinct holdings after each of its computes, in its compute order (first
    occurrences): all peaks() needs of the schedule, whatever the bytes."""
    last = schedule.stages * schedule.chunks - 1
    out = []
    for rank, actions in enumerate(schedule.ranks):  # .ranks converts them all: read once
        is_last = [schedule.virtual_stage(rank, k) == last for k in range(schedule.chunks)]
        acts = last_grads = 0
        by_chunk = [0] * schedule.chunks
        seen: dict[State, None] = {}
        for a in actions:
            op = a.op
            if op == "F":
                acts += 1
            elif op == "B":
                acts -= 1
            elif op in ("I", "W"):
                step = 1 if op == "I" else -1
                acts -= op == "I"
                by_chunk[a.chunk] += step
                last_grads += step * is_last[a.chunk]
            else:
                continue
            seen.setdefault((acts, tuple(by_chunk), last_grads))
        out.append(list(seen))
    return out


def peaks(
    schedule: sched.Schedule,
    activation_bytes: float | Sequence[float],
    weight_grad_bytes: Sequence[Sequence[float]],
    held_states: list[list[State]] | None = None,
) -> list[Held]:
    """The holdings at each rank's largest byte count, walking its compute order: a pair
    between F and I costs ``activation_bytes`` (or ``activation_bytes[rank]``: uneven stages),
    between I and W ``weight_grad_bytes[rank][chunk]``. The order alone decides what is held,
    not the timing. ``held_states``: states(schedule), when already known. Of equal byte
    counts the first with the most pairs wins (a repeated holding changes nothing)."""
    out = []
    for rank, rank_states in enumerate(held_states or states(schedule)):
        costs = weight_grad_bytes[rank]
        per_pair = activation_bytes
        if not isinstance(per_pair, (int, float)):
            per_pair = per_pair[rank]
        best, best_bytes = Held(0), -1.0
        for acts, by_chunk, last_grads in rank_states:
            held = acts * per_pair + sum(n * w for n, w in zip(by_chunk, costs, strict=True))
            grads = sum(by_chunk)
            if held > best_bytes or (held == best_bytes and acts + grads > best.in_flight):
                best, best_bytes = Held(acts, grads, last_grads), held
        out.append(best)
    return out


def theory_in_flight(pp: int, m: int, chunks: int, kind: str | None = None) -> list[int]:
    """Peak (microbatch, chunk) pairs held per pipeline rank (F to B, or F to W): 1F1B
    min(m, p - r); interleaved Megatron's warm-up (p - r - 1) 2 + (v - 1) p, plus the one in
    flight, capped at m v; zb-h1 min(m, p) on every rank (the first r Ws wait to the end);
    zb-v 2p half-size chunks on every rank (m >= 2p)."""
    kind = kind or ("interleaved" if chunks > 1 else "1f1b")
    if kind == "zb-h1":
        return [min(m, pp)] * pp
    if kind == "zb-v":
        return [min(2 * m, 2 * pp)] * pp
    if chunks == 1:
        return [min(m, pp - r) for r in range(pp)]
    return [min(m * chunks, (pp - r - 1) * 2 + (chunks - 1) * pp + 1) for r in range(pp)]
