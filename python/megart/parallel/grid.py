"""ParallelGrid: this process's place in the layout and its process groups. It is the one
context object that model, pipeline and optimizer code receive explicitly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megart.parallel.layout import Coords, GridLayout, GroupKind

if TYPE_CHECKING:  # importing megart.distributed loads torch; the grid itself does not need it
    from megart.distributed import ProcessGroup


@dataclass(frozen=True)
class ParallelGrid:
    """Made by ``megart.initialize``. Every group holds this rank; ``embedding_group`` is None
    on middle pipeline stages, which hold no embedding. Without context parallelism (cp = 1)
    ``cp_group`` is None (a group of one) and ``dp_cp_group`` is ``dp_group``."""

    layout: GridLayout
    rank: int
    coords: Coords
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    dp_group: ProcessGroup
    mp_group: ProcessGroup
    embedding_group: ProcessGroup | None
    cp_group: ProcessGroup | None = None
    dp_cp_group: ProcessGroup | None = None
    # Expert parallelism's (parallel.experts), made only at --expert-model-parallel-size > 1:
    # None otherwise (every rank holds every expert; their gradients average over dp x cp).
    ep_group: ProcessGroup | None = None
    edp_group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.dp_cp_group is None:  # cp = 1: averaging over dp x cp is over dp
            object.__setattr__(self, "dp_cp_group", self.dp_group)

    def group(self, kind: GroupKind) -> ProcessGroup | None:
        """The group of this kind: "tp", "pp", "dp", "cp", "dp_cp", "mp", "embedding", "ep" or
        "edp"."""
        return getattr(self, f"{kind}_group")

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.coords.pp_rank

    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank_of(self.rank)

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in the dp x cp group (cp innermost; Megatron's
        get_data_parallel_rank(with_context_parallel=True)): 0 is the one that writes what
        the group holds alike (Megatron's replica 0)."""
        return self.dp_rank * self.layout.cp + self.cp_rank

    @property
    def ep(self) -> int:
        """The expert-parallel size (1 without expert parallelism)."""
        return 1 if self.ep_group is None else self.ep_group.size()

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-model-parallel group (0 without one)."""
        return 0 if self.ep_group is None else self.ep_group.rank()

    @property
    def edp_rank(self) -> int:
        """This rank's place among the data-parallel ranks holding its experts: 0 is the one
        that saves them (its data-parallel rank without expert parallelism)."""
        return self.dp_cp_rank if self.ep_group is None else self.edp_group.rank()

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp_rank == self.layout.pp - 1

    @property
    def prev_pp_rank(self) -> int | None:
        """Global rank of the previous pipeline stage; None on the first."""
        return self.layout.prev_pp_rank(self.rank)

    @property
    def next_pp_rank(self) -> int | None:
        """Global rank of the next pipeline stage; None on the last."""
        return self.layout.next_pp_rank(self.rank)

    @property
    def rail(self) -> int:
        return self.layout.rail(self.rank)
