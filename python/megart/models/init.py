"""Where each parameter's initial values come from: a generator seeded by (model seed, the
parameter's place), so that a parameter's initial value does not depend on which stage or rank
builds it."""

from __future__ import annotations

import hashlib

import torch


def generator(seed: int, *where: object) -> torch.Generator:
    """A generator for one parameter, seeded by the model seed and the parameter's place."""
    digest = hashlib.sha256(repr((seed, *where)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
