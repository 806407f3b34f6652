"""Expert parallelism's groups (Megatron's --expert-model-parallel-size), a pure function of the
layout: no processes, no torch.

Megatron-Core's parallel_state with tensor- and context-parallel size 1: the expert-model-
parallel group of a rank is ``ep`` consecutive ranks of its data-parallel group (its data-
parallel ranks d with the same d // ep), each holding a different 1/ep of every MoE layer's
experts; the expert-data-parallel group is the data-parallel ranks with the same d % ep, which
hold the same experts and average their gradients. A rank's expert-parallel rank is d % ep,
its expert-data-parallel rank d // ep.
"""

from __future__ import annotations

from megart.errors import ConfigError
from megart.parallel.layout import GridLayout, divisors, either

FLAG = "--expert-model-parallel-size"


def check_expert_parallel(layout: GridLayout, ep: int, num_experts: int | None) -> None:
    """Refuses, by name, an expert-parallel size that does not split the data-parallel ranks
    or the experts, or that this first slice cannot run (tensor or context parallelism)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"{FLAG} {ep!r}: give a positive integer")
    if ep == 1:
        return
    if not num_experts:
        raise ConfigError(f"{FLAG} {ep} needs --num-experts (a model with MoE layers)")
    if layout.tp > 1 or layout.cp > 1:
        raise ConfigError(
            f"{FLAG} {ep} with tensor-parallel size {layout.tp} and context-parallel size "
            f"{layout.cp}: megart's expert parallelism runs at tensor- and context-parallel "
            f"size 1 only; use {FLAG} 1 there, or drop --tensor-model-parallel-size and "
            "--context-parallel-size to 1"
        )
    problems = []
    if layout.dp % ep:
        problems.append(
            f"it must divide the data-parallel size {layout.dp} (the expert-parallel ranks are "
            f"data-parallel ranks); sizes that fit: {either(divisors(layout.dp))}"
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
    for dp_group in layout.groups("dp"):
        model += [dp_group[i : i + ep] for i in range(0, len(dp_group), ep)]
        data += [dp_group[i::ep] for i in range(ep)]
    return sorted(model), sorted(data)


def expert_ranks(layout: GridLayout, ep: int, rank: int) -> tuple[int, int]:
    """(expert-parallel rank, expert-data-parallel rank) of a global rank."""
    d = layout.coords(rank).dp_rank
    return d % ep, d // ep
