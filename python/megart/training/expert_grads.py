"""Gradients under expert parallelism (--expert-model-parallel-size > 1): two bucket sets.

The dense parameters (attention, norms, embeddings, the routers) are on every data- and
context-parallel rank and average over their dp x cp ranks, as without experts. An expert (its
tensor-parallel shard under tp) is on the edp = dp x cp / ep ranks of one expert-data-parallel
group only, and its gradient there already sums the contributions of the tokens of all ep ranks
of its expert-model-parallel group (they were sent to it): its buckets average over the
expert-data-parallel group and scale by edp / (dp x cp), Megatron-Core's
expert_gradient_scaling_factor, so that the result is the sum over every data- and
context-parallel rank's tokens divided by dp x cp: what the dense gradients are, and what one
process computes.

With the distributed optimizer (--use-distributed-optimizer) each set shards over its own
group, as Megatron-Core's expert_parallel_buffers and its second DistributedOptimizer over the
expert-data-parallel group: a dense bucket is reduce-scattered into dp slices and all-gathered
over data parallelism, an expert bucket into edp slices over the expert-data-parallel group
(training.distributed_optimizer asks each bucket's ``owner``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megart.training.grad_sync import GradientBuckets


def is_expert(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` is an expert's weight spread over expert parallelism (models.moe)."""
    return getattr(p, "expert_parallel", False)


class SplitBuckets:
    """The dense and the expert bucket sets, driven together as one GradientBuckets (the
    trainer's and the distributed optimizer's calls); both shard or neither does."""

    def __init__(self, dense: GradientBuckets, experts: GradientBuckets) -> None:
        self.sets = (dense, experts)
        self.shard = dense.shard
        self._owner = {id(b): s for s in self.sets for b in s.buckets}

    @property
    def buckets(self) -> list:
        return [b for s in self.sets for b in s.buckets]

    @property
    def active(self) -> bool:
        return any(s.active for s in self.sets)

    def bucket_of(self, p: torch.nn.Parameter) -> object:
        return self.sets[is_expert(p)].bucket_of(p)

    def owner(self, bucket: object) -> GradientBuckets:
        """The set that reduces ``bucket``: over data parallelism, or the experts' over their
        expert-data-parallel group."""
        return self._owner[id(bucket)]

    def shard_range(self, bucket: object) -> tuple[int, int]:
        return self.owner(bucket).shard_range(bucket)

    def zero_grad(self) -> None:
        for s in self.sets:
            s.zero_grad()

    def start_iteration(self, backward_passes: int) -> None:
        for s in self.sets:
            s.start_iteration(backward_passes)

    def finish(self) -> None:
        for s in self.sets:
            s.finish()

    def remove(self) -> None:
        for s in self.sets:
            s.remove()


def split_buckets(
    params: Sequence[torch.nn.Parameter], grid: object, make: Callable[..., GradientBuckets]
) -> SplitBuckets:
    """The two sets over ``params``: ``make(params, group, scale=...)`` builds each (with the
    trainer's bucket options), the dense one over dp, the expert one over edp."""
    dense = [p for p in params if not is_expert(p)]
    experts = [p for p in params if is_expert(p)]
    edp, dp_cp = grid.edp_group.size(), grid.dp_cp_group.size()
    return SplitBuckets(
        make(dense, grid.dp_cp_group), make(experts, grid.edp_group, scale=edp / dp_cp)
    )
