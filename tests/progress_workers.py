"""Ranks of the progress-thread tests: async ops must move while the rank that posted them runs
Python code (here: sleeps) without calling into megart, and their failures must still reach
wait(). Times come from time.monotonic(), one clock for every process of the machine."""

from __future__ import annotations

import time

import torch

import megart.distributed as dist
from megart import CommError, CommTimeoutError

# 32 MiB of float32: many more bytes than one step of the staging area (2 MiB) carries, so the
# all_reduce needs the poster to advance it again and again after the post.
BIG = 8 << 20


def _completed_within(work: dist.Work, seconds: float) -> bool:
    """Polls is_completed() while sleeping. is_completed() advances ops but never looks for dead
    peers or deadlines: a failed op shows up as completed only if the progress thread found it."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if work.is_completed():
            return True
        time.sleep(0.05)
    return False


def big_all_reduce_while_poster_sleeps() -> dict[str, float]:
    dist.init(backend="shm", timeout=60)
    r = dist.get_rank()
    t = torch.full((BIG,), float(r + 1))
    if r == 0:
        work = dist.all_reduce(t, async_op=True)
        time.sleep(3)  # Python only: nothing calls into megart
        woke = time.monotonic()
        work.wait()
        assert bool((t == 3).all())
        return {"woke": woke}
    dist.all_reduce(t)  # synchronous, on the same data
    done = time.monotonic()
    assert bool((t == 3).all())
    return {"done": done}


def _unattended_all_reduce(poll_seconds: float, error: type[CommError]) -> str:
    """Rank 0 posts an all_reduce that cannot complete and leaves it to the progress thread;
    returns "<failed before wait()>|<the error wait() raised>"."""
    work = dist.all_reduce(torch.ones(10), async_op=True)
    found = _completed_within(work, poll_seconds)
    try:
        work.wait()
    except error as e:
        return f"{found}|{e}"
    return "no error"


def peer_dies_while_only_the_thread_waits() -> str:
    dist.init(backend="shm", timeout=30)
    if dist.get_rank() == 1:
        return "left"  # the process ends without joining the all_reduce
    return _unattended_all_reduce(20, CommError)


def timeout_while_only_the_thread_waits() -> str:
    dist.init(backend="shm", timeout=1.5)
    if dist.get_rank() == 1:
        time.sleep(5)
        return "slept"
    return _unattended_all_reduce(4, CommTimeoutError)


def abort_while_only_the_thread_waits() -> str:
    dist.init(backend="shm", timeout=30)
    if dist.get_rank() == 1:
        time.sleep(0.5)
        dist.abort()
        return "aborted"
    work = dist.irecv(torch.empty(4), src=1)
    time.sleep(2)
    try:
        work.wait()
    except CommError as e:
        return str(e)
    return "no error"


def destroy_with_ops_in_flight() -> int:
    """Groups made and dropped with async ops still pending (the peer never joins them): the
    progress thread must stop and be joined before the shared memory goes away."""
    dist.init(backend="shm", timeout=30)
    r = dist.get_rank()
    for _ in range(5):
        g = dist.new_group()
        if r == 0:
            dist.all_reduce(torch.ones(BIG), group=g, async_op=True)  # never completed: dropped
            time.sleep(0.01)  # the thread has taken it over
        dist.barrier()
        del g
    t = torch.ones(3)
    dist.all_reduce(t)
    return int(t.sum().item())
