"""Python's and numpy's global generators. megart draws nothing from them, but Megatron-LM seeds
both with ``--seed``, records them in its checkpoint files and restores them on load: megart
does the same, so that the files of one run are those of the next and a resume leaves the
process as Megatron-LM's would."""

from __future__ import annotations

import random
from typing import Any

import numpy as np


def seed_host_generators(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy takes 32-bit seeds only


def install_host_generators(python_state: Any, numpy_state: Any) -> None:
    """Restores the states a checkpoint recorded; a file without them leaves the generators
    as they are."""
    if python_state is not None:
        random.setstate(python_state)
    if numpy_state is not None:
        np.random.set_state(numpy_state)
