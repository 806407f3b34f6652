"""Expert parallelism's groups (Megatron's --expert-model-parallel-size), a pure function of the
layout: no processes, no torch.

Megatron-Core's parallel_state with the expert tensor-parallel size left at the tensor-parallel
size: the expert ranks are laid out tp-ep-dp-pp (its expert RankGenerator, no cp), where the
dense ranks are tp-cp-dp-pp, so the ep x edp expert ranks of each (tp rank, pipeline stage) are
its dp x cp data- and context-parallel ranks, in the order of their place d in the dp x cp group
(cp innermost: ParallelGrid.dp_cp_rank). The expert-model-parallel group of a rank is the ep of
them with the same d // ep (its tensor-parallel rank and stage, so that the tensor-parallel
shards of one expert never meet in an exchange; with cp > 1 a group may span context-parallel
ranks), each holding a different 1/ep of every MoE layer's experts; the expert-data-parallel
group is the dp x cp / ep of them with the same d % ep, which hold the same experts and average
their gradients. A rank's expert-parallel rank is d % ep, its expert-data-parallel rank d // ep.
"""

from __future__ import annotations

from megart.errors import ConfigError
from megart.parallel.layout import GridLayout, divisors, either

FLAG = "--expert-model-parallel-size"


def check_expert_parallel(layout: GridLayout, ep: int, num_experts: int | None) -> None:
    """Refuses, by name, an expert-parallel size that does not split the data- and context-
    parallel ranks or the experts."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"{FLAG} {ep!r}: give a positive integer")
    if ep == 1:
        return
    if not num_experts:
        raise ConfigError(f"{FLAG} {ep} needs --num-experts (a model with MoE layers)")
    problems = []
    ranks = layout.dp * layout.cp
    if ranks % ep:
        what = (
            f"the data-parallel size {layout.dp}"
            if layout.cp == 1
            else f"data-parallel size {layout.dp} x context-parallel size {layout.cp} = {ranks}"
        )
        problems.append(
            f"it must divide {what} (the expert-parallel ranks are data- and context-parallel "
            f"ranks); sizes that fit: {either(divisors(ranks))}"
        )
    if num_experts % ep:
        problems.append(
            f"it must divide --num-experts {num_experts} (each rank holds num_experts / "
            f"{FLAG} of them); sizes that fit: {either(divisors(num_experts))}"
        )
    if problems:
        raise ConfigError(f"{FLAG} {ep}: " + "; ".join(problems))


def expert_groups(layout: GridLayout, ep: int) -> tuple[list[tuple[int, ...]], ...]:
    """(every expert-model-parallel group, every expert-data-parallel group), each a tuple of
    global ranks in group-rank order, each list sorted by first rank, as every process must
    enumerate them to create them alike."""
    model: list[tuple[int, ...]] = []
    data: list[tuple[int, ...]] = []
    for ranks in _dp_cp_groups(layout):
        model += [ranks[i : i + ep] for i in range(0, len(ranks), ep)]
        data += [ranks[i::ep] for i in range(ep)]
    return sorted(model), sorted(data)


def expert_ranks(layout: GridLayout, ep: int, rank: int) -> tuple[int, int]:
    """(expert-parallel rank, expert-data-parallel rank) of a global rank."""
    d = layout.coords(rank).dp_rank * layout.cp + layout.cp_rank_of(rank)
    return d % ep, d // ep


def _dp_cp_groups(layout: GridLayout) -> list[tuple[int, ...]]:
    """Each (tp rank, stage)'s dp x cp ranks in the order of their place in that group (cp
    innermost)."""
    return [
        tuple(layout.rank_of(t, p, d, c) for d in range(layout.dp) for c in range(layout.cp))
        for p in range(layout.pp)
        for t in range(layout.tp)
    ]
