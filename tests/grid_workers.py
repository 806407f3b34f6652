"""Functions that run on every rank of a launched grid test (module level, so spawn can import
them)."""

from __future__ import annotations

import torch

import megart
import megart.distributed as dist


def grid_groups(tp: int, pp: int, dp: int | None) -> dict:
    """Initialises the grid, checks every group against the pure layout, and all-reduces 2**rank
    over each group: the sum is a bit mask naming exactly the ranks that took part."""
    grid = megart.initialize(tp=tp, pp=pp, dp=dp, timeout=60)
    layout, rank = grid.layout, grid.rank
    assert rank == dist.get_rank()
    assert grid.coords == layout.coords(rank)
    masks = {}
    for kind in ("tp", "pp", "dp", "mp", "embedding"):
        group = grid.group(kind)
        expected = layout.group_of(kind, rank)
        if expected is None:
            assert group is None, kind
            continue
        assert tuple(group.ranks) == expected, (kind, group.ranks, expected)
        assert group.rank() == expected.index(rank), kind
        t = torch.tensor([2**rank], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        masks[kind] = int(t.item())
    dist.barrier()
    return {
        "coords": tuple(grid.coords),
        "masks": masks,
        "prev": grid.prev_pp_rank,
        "next": grid.next_pp_rank,
    }
