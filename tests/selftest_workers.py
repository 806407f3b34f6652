"""Ranks of the selftest tests: the collectives comparison with a transport that is wrong."""

from __future__ import annotations

import torch

import megart.distributed as dist
from megart.selftest import collectives


def compare_with_a_broken_all_reduce() -> list[tuple[str, str, str | None]]:
    """The shm group's all_reduce adds 1 to its result (a faulty transport, as a GPU might
    show); the comparison must fail exactly the all_reduce checks and name the fallback."""
    dist.init(backend="shm", timeout=60)
    world = dist.new_group()  # compared with the torch group below
    reference = dist.new_group(backend="torch")
    real = dist.all_reduce

    def broken(tensor, op="sum", group=None, async_op=False):
        work = real(tensor, op=op, group=group, async_op=async_op)
        if group is world:
            tensor.add_(1)
        return work

    collectives.dist.all_reduce = broken
    try:
        checks = collectives.compare(world, reference, torch.device("cpu"), "shm", (torch.float32,))
    finally:
        collectives.dist.all_reduce = real
    dist.destroy()
    return [(c.name, c.status, c.avoid) for c in checks]
