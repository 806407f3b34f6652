"""When each pipeline rank posts its messages, and which go together, so that every transport
can run the schedule: NCCL's included.

NCCL matches the point-to-point calls of two ranks in order, and only when both ranks group
them alike: the ops between a pair of ranks must fall into the same groups (ncclGroupStart/End)
on both sides, in the same order. Its maintainers call anything else undefined behaviour
(NVIDIA/nccl#1279); on an H200, megart's first pipeline runs over NCCL failed with "Message
truncated" because one rank posted [send F0, recv B0] together while its neighbour posted
[recv F0] alone. NCCL also runs a communicator's groups one after another, in the order they
were posted, so the order must leave no cycle of waits between ranks.

The schedule gives each rank an order of compute and communication actions, written for one
rank at a time. This module turns the schedules of all ranks into posting plans that agree,
by playing them forward together in rounds:

1. every rank runs its next compute action if its input is there (a received message whose
   round is over, or a hand-over from a chunk on the same rank), and collects the
   communication actions it passes on the way as pending;
2. every pending op whose partner (the op on the other rank, matched first-in first-out per
   direction, as NCCL matches them) is pending too is posted in this round: each rank's
   share of the round is one group.

One compute per rank per round keeps the groups as small as the schedule's own batches (a
message goes in the first round both its ends are waiting), so a transfer waits for nothing
but its own partner.

A group goes into its rank's order as early as it can: right after the compute that made its
last send (and after the rank's previous group), not where the rounds found it, so a send
leaves as soon as its tensor exists and transfers overlap the compute that follows.

A pair's ops in a round are the same on both ranks by construction, and every rank posts its
groups in round order, so round numbers order all groups of all ranks: nothing waits on a
later round. A schedule for which a round finds nothing to post while some rank is not done
cannot run on any transport that blocks, and is refused. Every transport runs the same plan,
so the CPU runs test the grouping the GPU runs use.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megart import schedule as sched
from megart.errors import ScheduleError


@dataclass(frozen=True)
class Step:
    """One thing a rank does, in its order: run a compute action (``compute``), or post
    communication actions as one group (``post``, in the schedule's order)."""

    compute: sched.Action | None = None
    post: tuple[sched.Action, ...] = ()


def _needs(s: sched.Schedule, rank: int, a: sched.Action) -> tuple[str, int, int] | None:
    """The received message compute action ``a`` of ``rank`` waits for, as (kind, mb, chunk),
    or None: the first stage's forward and the last stage's backward take no message, nor does
    a chunk whose neighbouring virtual stage is on the same rank (a hand-over), nor W."""
    stage = s.virtual_stage(rank, a.chunk)
    last = s.stages * s.chunks - 1
    if a.op == "F":
        neighbour = stage - 1
        if stage == 0:
            return None
    elif a.op in ("B", "I"):
        neighbour = stage + 1
        if stage == last:
            return None
    else:  # W: only this rank's own kept tensors
        return None
    on_rank = any(s.virtual_stage(rank, c) == neighbour for c in range(s.chunks))
    return None if on_rank else ("F" if a.op == "F" else "B", a.mb, a.chunk)


def plan(s: sched.Schedule) -> list[list[Step]]:
    """Every rank's steps for schedule ``s`` (the same on every rank that computes it)."""
    p = s.stages
    todo = [list(s.ranks[r]) for r in range(p)]
    position = [0] * p
    computes: list[list[sched.Action]] = [[] for _ in range(p)]
    # Each group with its anchor: posted after that many of the rank's computes.
    groups: list[list[tuple[int, tuple[sched.Action, ...]]]] = [[] for _ in range(p)]
    pending: list[list[tuple[int, sched.Action]]] = [[] for _ in range(p)]  # (anchor, op)
    received: list[set[tuple[str, int, int]]] = [set() for _ in range(p)]

    def advance(r: int) -> bool:
        """Runs r's next compute if its input is there, passing the messages before and after
        it (they become pending); True if a compute ran."""
        ran = False
        while position[r] < len(todo[r]):
            a = todo[r][position[r]]
            if a.is_compute:
                if ran:
                    return True
                need = _needs(s, r, a)
                if need is not None and need not in received[r]:
                    return False
                computes[r].append(a)
                ran = True
            else:
                pending[r].append((len(computes[r]), a))
            position[r] += 1
        return ran

    while True:
        ran = [advance(r) for r in range(p)]
        if all(position[r] == len(todo[r]) and not pending[r] for r in range(p)):
            return [_merge(computes[r], groups[r]) for r in range(p)]
        # Pending ops by direction, in each rank's order: the k-th send from a to b meets
        # the k-th receive on b from a.
        sends: dict[tuple[int, int], list[sched.Action]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[sched.Action]] = defaultdict(list)
        for r in range(p):
            for _, a in pending[r]:
                if a.op.startswith("SEND"):
                    sends[(r, a.peer)].append(a)
                else:
                    recvs[(a.peer, r)].append(a)
        posted: set[int] = set()  # ids of the actions going in this round
        for direction in set(sends) & set(recvs):
            for out, into in zip(sends[direction], recvs[direction], strict=False):
                if out.op[-1] != into.op[-1] or out.mb != into.mb:
                    raise ScheduleError(
                        f"the schedule's messages from rank {direction[0]} to rank "
                        f"{direction[1]} do not pair in order: {out.op} of microbatch "
                        f"{out.mb} meets {into.op} of microbatch {into.mb}"
                    )
                posted.update((id(out), id(into)))
        if not posted and not any(ran):
            stuck = {r: [a.op for _, a in pending[r]] for r in range(p) if pending[r]}
            raise ScheduleError(
                "the schedule cannot make progress: every rank waits for a message no rank "
                f"posts (pending ops per rank: {stuck})"
            )
        for r in range(p):
            going = [(anchor, a) for anchor, a in pending[r] if id(a) in posted]
            if not going:
                continue
            earliest = groups[r][-1][0] if groups[r] else 0
            anchor = max([earliest] + [anchor for anchor, _ in going])
            groups[r].append((anchor, tuple(a for _, a in going)))
            pending[r] = [(n, a) for n, a in pending[r] if id(a) not in posted]
            received[r].update((a.op[-1], a.mb, a.chunk) for _, a in going if a.op[0] == "R")


def _merge(
    computes: list[sched.Action], groups: list[tuple[int, tuple[sched.Action, ...]]]
) -> list[Step]:
    """One rank's steps: its computes in order, each group after its anchor's computes."""
    steps: list[Step] = []
    g = 0
    for n in range(len(computes) + 1):
        while g < len(groups) and groups[g][0] == n:
            steps.append(Step(post=groups[g][1]))
            g += 1
        if n < len(computes):
            steps.append(Step(compute=computes[n]))
    return steps
