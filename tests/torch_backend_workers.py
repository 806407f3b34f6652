"""Ranks of the torch-backend tests: one script of every megart.distributed op, run on a given
backend, returning what each op left on this rank, so that the parent compares backends."""

from __future__ import annotations

import torch

import megart.distributed as dist
from dist_workers import DTYPES

SIZES = [1, 7, 4099]


def _value(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    # Small integers: every dtype holds them and their sums exactly.
    return ((torch.arange(n, dtype=torch.int64) * (salt + 1) % 5) + rank + 1).to(dtype)


def every_op(backend: str) -> dict[str, torch.Tensor | list | dict]:
    dist.init(backend=backend, timeout=60)
    r, w = dist.get_rank(), dist.get_world_size()
    out: dict[str, torch.Tensor | list | dict] = {}
    for dtype in DTYPES:
        for n in SIZES:
            key = f"{dtype}/{n}"
            mine = _value(r, n, dtype)
            for op in ("sum", "max", "min") + (("avg",) if dtype.is_floating_point else ()):
                t = mine.clone()
                dist.all_reduce(t, op=op)
                out[f"all_reduce {op} {key}"] = t
            gathered = torch.empty(w * n, dtype=dtype)
            dist.all_gather_into_tensor(gathered, mine)
            out[f"all_gather {key}"] = gathered
            scattered = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(scattered, _value(r, w * n, dtype, 1))
            out[f"reduce_scatter {key}"] = scattered
            t = mine.clone()
            dist.broadcast(t, src=w - 1)
            out[f"broadcast {key}"] = t
            # A ring in both directions, posted together.
            left, right = torch.empty_like(mine), torch.empty_like(mine)
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, mine, (r + 1) % w),
                    dist.P2POp(dist.isend, mine, (r - 1) % w),
                    dist.P2POp(dist.irecv, left, (r - 1) % w),
                    dist.P2POp(dist.irecv, right, (r + 1) % w),
                ]
            )
            for wk in works:
                wk.wait()
            out[f"ring {key}"] = torch.cat([left, right])
    # send/recv and isend/irecv between rank 0 and the last rank.
    dist.reset_bytes_sent()
    got = torch.zeros(10)
    if r == 0:
        dist.send(torch.arange(10.0), w - 1)
        dist.isend(torch.arange(10.0) * 2, w - 1).wait()
    elif r == w - 1:
        assert dist.recv(got, 0) == 0
        more = torch.zeros(10)
        dist.irecv(more, 0).wait()
        got = torch.cat([got, more])
    out["send/recv"] = got
    out["bytes_sent"] = dist.bytes_sent()
    # Subgroups (members and not), async ops waited in reverse, wait_stream on a host op.
    evens = dist.new_group([q for q in range(w) if q % 2 == 0])
    odds = dist.new_group([q for q in range(w) if q % 2 == 1])
    group = evens if r % 2 == 0 else odds
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t, group=group)
    out["subgroup"] = [t, dist.get_rank(group), (odds if r % 2 == 0 else evens).rank()]
    b = torch.tensor([float(r)])
    dist.broadcast(b, src=group.ranks[-1], group=group)
    out["subgroup broadcast"] = b
    tensors = [torch.full((1000 * (i + 1),), float(r + i)) for i in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in tensors]
    for wk in reversed(works):
        assert wk.wait()
    out["async"] = torch.cat(tensors)
    x = torch.full((5,), float(r))
    dist.all_reduce(x, op="max", async_op=True).wait_stream()
    out["wait_stream"] = x
    dist.barrier()
    dist.destroy()
    return out
