"""What a real megart train step exchanges under context parallelism, for the planner's
exchange tests: each all-to-all (--cp-comm-type a2a), ring pass (p2p) or all-gather and
reduce-scatter (all_gather) the rank posts during one step, and the bytes its transport sent
to each peer of its context-parallel group."""

from __future__ import annotations

import torch

from megart.training.config import TrainConfig
from megart.training.data import builtin_corpus


def a2a_traffic(kw: dict) -> dict:
    """One megart train step's all-to-alls (--cp-comm-type a2a) on this rank: each call's
    buffer (elements, element size), in the order posted, and the bytes the rank sent to each
    peer of its context-parallel group (its transport's own count), after a first step."""
    import megart.models.all_to_all_attention as a2a
    from megart.distributed import bytes_sent, reset_bytes_sent
    from megart.training.trainer import Trainer

    trainer = Trainer(TrainConfig(**kw), tokens=builtin_corpus(1 << 16))
    trainer.train_step(0)
    calls: list[tuple[int, int]] = []
    real = a2a.all_to_all

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append((x.numel(), x.element_size()))
        return real(x, *args)

    group = trainer.grid.cp_group
    reset_bytes_sent(group)
    a2a.all_to_all = counted
    try:
        trainer.train_step(1)
    finally:
        a2a.all_to_all = real
    sent = {peer: n for peer, n in bytes_sent(group).items() if n}
    return {"calls": calls, "sent": sent, "cp_ranks": list(group.ranks)}


def cp_traffic(kw: dict) -> dict:
    """One megart train step's context-parallel exchanges on this rank, after a first step: under
    the ring (--cp-comm-type p2p) each block the rank passes on (models.ring_attention's
    _Ring.pass_on), under all_gather each all-gather and reduce-scatter over the cp group, as
    (phase, kind, elements of the rank's own part, element size) in the order posted, phase
    "backward" while torch's autograd engine runs (recomputation's replays among them); and the
    bytes the rank sent to each peer by point-to-point ops in the cp group (its transport's own
    count: the ring's messages)."""
    import megart.distributed as dist
    from megart.models.ring_attention import _Ring
    from megart.training.trainer import Trainer

    trainer = Trainer(TrainConfig(**kw), tokens=builtin_corpus(1 << 16))
    trainer.train_step(0)
    group = trainer.grid.cp_group
    calls: list[tuple[str, str, int, int]] = []
    pass_on, gather, scatter = (
        _Ring.pass_on,
        dist.all_gather_into_tensor,
        dist.reduce_scatter_tensor,
    )

    def note(kind: str, x: torch.Tensor) -> None:
        # The engine's graph task id is -1 outside a backward (torch has no public query).
        phase = "forward" if torch._C._current_graph_task_id() == -1 else "backward"
        calls.append((phase, kind, x.numel(), x.element_size()))

    def passed(ring: _Ring, block: torch.Tensor) -> tuple:
        note("p2p", block)
        return pass_on(ring, block)

    def gathered(out: torch.Tensor, x: torch.Tensor, group: object = None, **kw: object) -> object:
        if group is trainer.grid.cp_group:
            note("all_gather", x)
        return gather(out, x, group=group, **kw)

    def scattered(out: torch.Tensor, x: torch.Tensor, *args: object, **kw: object) -> object:
        if kw.get("group") is trainer.grid.cp_group:  # mappings._reduce_scatter names it
            note("reduce_scatter", out)
        return scatter(out, x, *args, **kw)

    dist.reset_bytes_sent(group)
    _Ring.pass_on = passed
    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = gathered, scattered
    try:
        trainer.train_step(1)
    finally:
        _Ring.pass_on = pass_on
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = gather, scatter
    sent = {peer: n for peer, n in dist.bytes_sent(group).items() if n}
    return {
        "calls": calls,
        "sent": sent,
        "cp_ranks": list(group.ranks),
        "cp_rank": group.rank(),
    }
