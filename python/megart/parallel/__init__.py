"""The rank grid: where each rank sits in tensor x pipeline x data parallelism.

>>> layout = make_layout(16, tp=2, pp=4)       # pure: no processes
>>> layout.coords(5), layout.group_of("pp", 5)
(Coords(tp_rank=1, pp_rank=1, dp_rank=0), (1, 5, 9, 13))
>>> grid = megart.initialize(tp=2, pp=4)       # in launched processes: groups too

Importing this package does not load torch; ``initialize`` does, when called.
"""

from megart.parallel.checks import check_model_fits
from megart.parallel.grid import ParallelGrid
from megart.parallel.initialize import initialize
from megart.parallel.layout import (
    DEFAULT_ORDER,
    GROUP_KINDS,
    ORDERS,
    Coords,
    GridLayout,
    make_layout,
)

__all__ = [
    "DEFAULT_ORDER",
    "GROUP_KINDS",
    "ORDERS",
    "Coords",
    "GridLayout",
    "ParallelGrid",
    "check_model_fits",
    "initialize",
    "make_layout",
]
