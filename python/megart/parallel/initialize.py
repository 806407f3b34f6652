"""megart.initialize(): from a launched set of processes to a ParallelGrid."""

from __future__ import annotations

import os
from datetime import timedelta

from megart.errors import ConfigError
from megart.parallel.experts import check_expert_parallel, expert_groups
from megart.parallel.grid import ParallelGrid
from megart.parallel.layout import (
    CP_GROUP_KINDS,
    DEFAULT_ORDER,
    GROUP_KINDS,
    GridLayout,
    make_layout,
)


def initialize(
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    order: str = DEFAULT_ORDER,
    gpus_per_node: int | None = None,
    backend: str | None = None,
    timeout: timedelta | float = timedelta(minutes=10),
    cp: int = 1,
    ep: int = 1,
    num_experts: int | None = None,
) -> ParallelGrid:
    """Lays the world out as tp x cp x pp x dp ranks in ``order`` (cp just inside dp) and makes
    every process group.

    Initialises megart.distributed first when it is not yet (from torchrun's environment, or as
    a one-process world; ``backend`` and ``timeout`` are passed on). Every process must call
    this with the same arguments: each one creates every group, members or not, in the same
    order, because new_group is collective by convention. ``gpus_per_node`` None reads
    LOCAL_WORLD_SIZE (set by torchrun), or treats the world as one node.
    """
    # Here, not at module level: importing megart must not load torch.
    import megart.distributed as dist
    from megart.distributed.group import context

    if dist.is_initialized():
        world_backend = context().world.backend
        if backend is not None and backend != world_backend:
            raise ConfigError(
                f"megart.distributed is already initialised with backend {world_backend!r}, "
                f"not {backend!r}; call megart.distributed.destroy() first or drop backend"
            )
        started_here = False
    else:
        dist.init(backend=backend, timeout=timeout)
        started_here = True
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if gpus_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        gpus_per_node = int(local) if local and local.isdigit() else world_size
    # Checked before any group exists, so a bad layout fails the same way on every rank and
    # leaves things as they were: the caller may fix the sizes and call again.
    try:
        layout = make_layout(world_size, tp, pp, dp, order, gpus_per_node, cp)
        check_expert_parallel(layout, ep, num_experts)
    except ConfigError:
        if started_here:
            dist.destroy()
        raise

    # Errors of the groups made below name a peer by its global rank and coordinates.
    from megart.distributed.group import describe_ranks

    describe_ranks([_label(layout, r) for r in range(world_size)])
    mine: dict[str, dist.ProcessGroup | None] = {}
    for kind in GROUP_KINDS + (CP_GROUP_KINDS if layout.cp > 1 else ()):
        mine[kind] = None
        for ranks in layout.groups(kind):
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine[kind] = group
    if ep > 1:  # made only then: at ep 1 the expert groups are the data-parallel ones
        for kind, groups in zip(("ep", "edp"), expert_groups(layout, ep), strict=True):
            for ranks in groups:
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    mine[kind] = group
    return ParallelGrid(
        layout=layout,
        rank=rank,
        coords=layout.coords(rank),
        tp_group=mine["tp"],
        pp_group=mine["pp"],
        dp_group=mine["dp"],
        mp_group=mine["mp"],
        embedding_group=mine["embedding"],
        cp_group=mine.get("cp"),
        dp_cp_group=mine.get("dp_cp"),
        ep_group=mine.get("ep"),
        edp_group=mine.get("edp"),
    )


def _label(layout: GridLayout, rank: int) -> str:
    c = layout.coords(rank)
    cp = f", cp {layout.cp_rank_of(rank)}" if layout.cp > 1 else ""
    return f"global rank {rank} (tp {c.tp_rank}, pp {c.pp_rank}, dp {c.dp_rank}{cp})"
