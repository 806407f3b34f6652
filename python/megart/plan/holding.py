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


def peak(
    schedule: sched.Schedule,
    rank: int,
    activation_bytes: float,
    weight_grad_bytes: Sequence[float],
) -> Held:
    """The holdings at ``rank``'s largest byte count, walking its compute order: each pair
    between F and I costs ``activation_bytes``, between I and W ``weight_grad_bytes[chunk]``.
    The order alone decides what is held, not the timing."""
    last = schedule.stages * schedule.chunks - 1
    acts = grads = last_grads = 0
    best, best_bytes = Held(0), -1.0
    by_chunk = [0.0] * schedule.chunks
    for a in schedule.ranks[rank]:
        if not a.is_compute:
            continue
        op = str(a.op)
        if op == "F":
            acts += 1
        elif op == "B":
            acts -= 1
        elif op == "I":
            acts -= 1
            grads += 1
            by_chunk[a.chunk] += 1
            last_grads += schedule.virtual_stage(rank, a.chunk) == last
        elif op == "W":
            grads -= 1
            by_chunk[a.chunk] -= 1
            last_grads -= schedule.virtual_stage(rank, a.chunk) == last
        held = acts * activation_bytes + sum(
            n * w for n, w in zip(by_chunk, weight_grad_bytes, strict=True)
        )
        if held > best_bytes or (held == best_bytes and acts + grads > best.in_flight):
            best, best_bytes = Held(acts, grads, last_grads), held
    return best


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
