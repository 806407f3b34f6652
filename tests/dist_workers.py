"""Functions that run on every rank of a launched test (module level, so spawn can import them).
Each checks results against exact expectations computed locally, and returns what the parent
test asserts on."""

from __future__ import annotations

import os
import time

import torch

import megart.distributed as dist
from megart import CommError, CommTimeoutError

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
]
SIZES = [1, 7, 1_000_003]


def _value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: every dtype holds them and their sums exactly.
    return ((torch.arange(n, dtype=torch.int64) % 5) + rank + 1).to(dtype)


def every_op_and_dtype() -> int:
    dist.init(backend="shm", timeout=60)
    r, w = dist.get_rank(), dist.get_world_size()
    checked = 0
    for dtype in DTYPES:
        for n in SIZES:
            parts = [_value(q, n, dtype) for q in range(w)]
            stacked = torch.stack([p.to(torch.float64) for p in parts])
            for op, expect in (
                ("sum", stacked.sum(0)),
                ("max", stacked.max(0).values),
                ("min", stacked.min(0).values),
            ):
                t = parts[r].clone()
                dist.all_reduce(t, op=op)
                assert torch.equal(t, expect.to(dtype)), (dtype, n, op)
            if dtype.is_floating_point:
                t = parts[r].clone()
                dist.all_reduce(t, op="avg")
                torch.testing.assert_close(t, (stacked.sum(0) / w).to(dtype))
            out = torch.empty(w * n, dtype=dtype)
            dist.all_gather_into_tensor(out, parts[r])
            assert torch.equal(out, torch.cat(parts)), (dtype, n, "all_gather")
            full = [_value(q, w * n, dtype) for q in range(w)]
            mine = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(mine, full[r])
            total = torch.stack([f.to(torch.float64) for f in full]).sum(0)
            assert torch.equal(mine, total[r * n : (r + 1) * n].to(dtype)), (dtype, n, "rs")
            for root in {0, w - 1}:
                t = parts[r].clone()
                dist.broadcast(t, src=root)
                assert torch.equal(t, parts[root]), (dtype, n, "broadcast")
            checked += 1
    dist.barrier()
    return checked


def subgroups_and_async_in_reverse() -> list[int]:
    dist.init(backend="shm", timeout=60)
    r, w = dist.get_rank(), dist.get_world_size()
    evens = dist.new_group([q for q in range(w) if q % 2 == 0])
    odds = dist.new_group([q for q in range(w) if q % 2 == 1])
    mine = evens if r % 2 == 0 else odds
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mine)
    assert t.item() == sum(q for q in mine.ranks)
    assert dist.get_rank(mine) == mine.ranks.index(r)
    assert (evens if r % 2 else odds).rank() == -1
    # Several async ops in flight, waited in reverse order.
    tensors = [torch.full((1000 * (i + 1),), float(r + i)) for i in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in tensors]
    for wk in reversed(works):
        assert wk.wait()
    for i, x in enumerate(tensors):
        assert bool((x == sum(q + i for q in range(w))).all())
    # Broadcast from a global rank inside a subgroup.
    b = torch.tensor([float(r)])
    dist.broadcast(b, src=mine.ranks[-1], group=mine)
    assert b.item() == mine.ranks[-1]
    return mine.ranks


def p2p_plan(plan: list[tuple[int, int, int, str]], batches: int) -> dict[int, int]:
    """Runs `plan` (src, dst, size, dtype) split into `batches` batches: each rank posts its
    sends and receives of a batch together, then waits for all of them."""
    dist.init(backend="shm", timeout=60)
    r = dist.get_rank()
    dist.reset_bytes_sent()
    size = max(1, (len(plan) + batches - 1) // batches)
    expected_bytes: dict[int, int] = {}
    for start in range(0, len(plan), size):
        ops, checks = [], []
        for k, (src, dst, n, dtype_name) in enumerate(plan[start : start + size], start):
            dtype = getattr(torch, dtype_name)
            payload = ((torch.arange(n) * 7 + k) % 101).to(dtype)
            if r == src:
                ops.append(dist.P2POp(dist.isend, payload, dst))
                if n:
                    expected_bytes[dst] = expected_bytes.get(dst, 0) + payload.nbytes
            if r == dst:
                buf = torch.empty(n, dtype=dtype)
                ops.append(dist.P2POp(dist.irecv, buf, src))
                checks.append((buf, payload))
        for wk in dist.batch_isend_irecv(ops) if ops else []:
            wk.wait()
        for buf, payload in checks:
            assert torch.equal(buf, payload)
    sent = {peer: n for peer, n in dist.bytes_sent().items() if n}
    assert sent == expected_bytes, (sent, expected_bytes)
    dist.barrier()
    return sent


def peer_exits_mid_collective() -> str:
    dist.init(backend="shm", timeout=30)
    if dist.get_rank() == 1:
        return "left"  # the process ends without joining the all_reduce
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
    except CommError as e:
        return f"{time.monotonic() - t0:.1f}|{e}"
    return "no error"


def peer_stuck_past_timeout() -> str:
    dist.init(backend="shm", timeout=1.5)
    if dist.get_rank() == 1:
        time.sleep(4)
        return "slept"
    try:
        dist.all_reduce(torch.ones(10))
    except CommTimeoutError as e:
        assert isinstance(e, TimeoutError)
        return str(e)
    return "no error"


def abort_unblocks_the_others() -> str:
    dist.init(backend="shm", timeout=30)
    if dist.get_rank() == 1:
        time.sleep(0.5)
        dist.abort()
        return "aborted"
    try:
        dist.recv(torch.empty(4), src=1)
    except CommError as e:
        return str(e)
    return "no error"


def mismatched_calls() -> list[str]:
    dist.init(backend="shm", timeout=30)
    r = dist.get_rank()
    errors = []
    try:
        dist.all_reduce(torch.ones(8 if r == 0 else 16))
    except CommError as e:
        errors.append(str(e))
    try:  # the group is now broken: later ops are refused, with the reason
        dist.barrier()
    except CommError as e:
        errors.append(str(e))
    g = dist.new_group()  # a fresh group works
    if r == 0:
        dist.send(torch.ones(4), dst=1, group=g)
    else:
        try:
            dist.recv(torch.empty(5), src=0, group=g)
        except CommError as e:
            errors.append(str(e))
    return errors


def mismatched_grouping() -> str:
    """Rank 0 posts [send x, recv y] as one batch, rank 1 posts [recv x] and later [send y]:
    NCCL leaves that undefined (on an H200: "Message truncated"); shm refuses it on rank 1."""
    dist.init(backend="shm", timeout=30)
    r = dist.get_rank()
    x, y = torch.ones(4), torch.empty(4)
    try:
        if r == 0:
            ops = [dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, y, 1)]
            for wk in dist.batch_isend_irecv(ops):
                wk.wait()
        else:
            dist.recv(y, src=0)
            dist.send(x, dst=0)
    except CommError as e:
        return str(e)
    return "no error"


def world_and_agent_variable() -> tuple[int, str | None]:
    """A rank's world once joined, and whether torchrun's agent-store variable reached it."""
    dist.init()
    try:
        return dist.get_world_size(), os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    finally:
        dist.destroy()
