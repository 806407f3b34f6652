"""Under expert parallelism Megatron-Core (0.16.1: optimizer/__init__.py get_megatron_optimizer,
optimizer.py ChainedOptimizer.sharded_state_dict) chains two DistributedOptimizers: the dense
parameters' over the data x context-parallel ranks, numbered by the rank's place in the
model-parallel group, and the experts' over their expert-data-parallel ranks, numbered by its
place in the expert tensor x expert x pipeline group. In the dp_reshardable layout of a
torch_dist store (megart.training.megatron_dist_distopt) the chain prefixes each one's keys with
its place in it, ``chained_0.`` and ``chained_1.``, whatever the content metadata's
chained_optim_avoid_prefix says; common.pt's optimizer is ``{0: dense, 1: experts}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megart.training.expert_grads import is_expert
from megart.training.megatron_dist_distopt import group_prefix
from megart.training.megatron_distrib_optim import dp_cp_size

CHAIN = ("chained_0.", "chained_1.")


def expert_prefix(tp_rank: int, pp_rank: int, ep_rank: int, tp: int, ep: int) -> str:
    """The experts' optimizer's keys' prefix: its group number is the rank's place in Megatron-
    Core's expert tensor x expert-parallel x pipeline group (tp-ep-pp, tp innermost), so each
    expert-parallel rank's experts have buckets of their own."""
    return (
        f"{CHAIN[1]}optimizer.distributed.dp_group_idx_{tp_rank + tp * (ep_rank + ep * pp_rank)}."
    )


@dataclass(frozen=True)
class Part:
    """One DistributedOptimizer of the store: its keys' prefix, its parameters (None: all;
    True: the experts' under expert parallelism; False: the others), the ranks its buffers
    shard over and this rank's place among them (0 writes the gaps and objects)."""

    prefix: str
    experts: bool | None
    shard: int
    rank: int


def parts(grid: Any, tp: int, ep: int, args: dict[str, Any]) -> list[Part]:
    """This rank's optimizers in the store: one, or under expert parallelism Megatron-Core's
    chain of the dense parameters' (over data x context parallelism) and the experts' (over
    their expert-data-parallel ranks)."""
    dp_cp = dp_cp_size(args)
    dense = group_prefix(grid.tp_rank, grid.pp_rank, tp)
    if ep == 1:
        return [Part(dense, None, dp_cp, grid.dp_cp_rank)]
    experts = expert_prefix(grid.tp_rank, grid.pp_rank, grid.ep_rank, tp, ep)
    return [Part(CHAIN[0] + dense, False, dp_cp, grid.dp_cp_rank),
            Part(experts, True, dp_cp // ep, grid.edp_rank)]  # fmt: skip


def part_groups(groups: list[dict[str, Any]], optimizer: Any, experts: bool | None) -> list:
    """Megatron's param groups of one optimizer of the chain: those holding its parameters,
    keyed ``is_expert_parallel`` (Megatron-Core's _get_param_groups); all without a chain."""
    if experts is None:
        return groups
    return [
        {**g, "is_expert_parallel": experts}
        for g, live in zip(groups, optimizer.param_groups, strict=True)
        if any(is_expert(p) == experts for p in live["params"])
    ]
