"""A rank of the chaos test (tests/test_chaos.py), started as a plain process per rank with
torchrun's variables and no launcher that would clean up after a death. It joins, builds a
pp2 x dp2 grid and then loops over what training does: asynchronous data-parallel all-reduces
waited on out of order (grad_sync's buckets), pipeline send/recv, world all-reduces."""

from __future__ import annotations

import faulthandler
import signal
import sys
import time

import torch

import megart
import megart.distributed as dist


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # the test asks a rank that hangs where it is
    dist.init(backend="shm", timeout=float(sys.argv[1]))
    print("joined", flush=True)
    grid = megart.initialize(tp=1, pp=2, dp=2)
    a, b, x = torch.ones(1000), torch.ones(100_096), torch.zeros(64)
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        w1 = dist.all_reduce(a, group=grid.dp_group, async_op=True)
        w2 = dist.all_reduce(b, group=grid.dp_group, async_op=True)
        w2.wait()  # the later one first: it has not started while the first runs
        w1.wait()
        peer = 1 - grid.pp_rank
        ranks = grid.pp_group.ranks
        if grid.pp_rank == 0:
            dist.send(x, ranks[peer], group=grid.pp_group)
        else:
            dist.recv(x, ranks[peer], group=grid.pp_group)
        dist.all_reduce(x)
    print("done", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # When this rank noticed (wall clock): its exit then takes the interpreter's shutdown,
        # seconds on a loaded machine, which the test bounds separately.
        print(f"noticed-at {time.time()}", file=sys.stderr, flush=True)
        raise
