"""A rank of tests/test_stopped_rank.py, one plain process per rank with torchrun's variables:
a tp2 x dp2 grid whose ranks all-reduce over a group of every rank until one of them is
stopped (SIGSTOP) and the others' waits run out."""

from __future__ import annotations

import sys

import torch

import megart
import megart.distributed as dist


def main() -> None:
    grid = megart.initialize(tp=2, pp=1, dp=2, backend="shm", timeout=float(sys.argv[1]))
    everyone = dist.new_group()  # made after the grid: its errors name coordinates
    x = torch.ones(16)
    dist.all_reduce(x, group=everyone)
    print(f"joined {grid.coords}", flush=True)
    while True:
        dist.all_reduce(x, group=everyone)
        x.fill_(1.0)


if __name__ == "__main__":
    main()
