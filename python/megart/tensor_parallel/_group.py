"""Size and rank of a tensor-parallel group, where None means "no tensor parallelism".

megart.distributed reads ``group=None`` as the world group (torch.distributed's convention);
tensor-parallel code reads it as a group of one, so a module runs in one process without
``init()``. These helpers are the only place that difference is handled.
"""

from __future__ import annotations

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.errors import ConfigError


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    if group is None:
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ConfigError(
            f"this process is not a member of tensor-parallel group '{group.name}' "
            f"(ranks {group.ranks}); pass the group this rank belongs to"
        )
    return rank


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when exact; otherwise a ConfigError naming ``what``."""
    if numerator % denominator:
        raise ConfigError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator
