"""Every collective and point-to-point op of a megart group against the expected values and
against the same op on torch.distributed's group of the same ranks (``backend="torch"``).

Device-agnostic: on a GPU it compares megart's nccl transport with torch's NCCL; on CPU the same
code compares the shm transport with gloo (which is how its logic is tested without a GPU).
Every rank calls :func:`compare` with the same arguments; the errors are the largest over ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import megart.distributed as dist
from megart.selftest.report import Check, judged, relative_error, timed

TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
AVOID = "--distributed-backend torch"
NUMEL = 4096


def _inputs(rank: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Small integers: every sum of a few of them is exact in every dtype, so the expected
    # values are exact and the tolerance only covers avg's division.
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype=dtype, device=device)


def _ops(
    ranks: list[int], me: int, dtype: torch.dtype, device: torch.device
) -> dict[str, tuple[Callable[[dist.ProcessGroup], torch.Tensor], torch.Tensor]]:
    """name -> (run the op on a group and return what this rank holds, the expected tensor)."""
    n = len(ranks)
    mine = _inputs(me, NUMEL, dtype, device)
    every = torch.stack([_inputs(r, NUMEL, torch.float64, torch.device("cpu")) for r in ranks])
    pos = ranks.index(me)

    def all_reduce(op: str) -> Callable[[dist.ProcessGroup], torch.Tensor]:
        def run(g: dist.ProcessGroup) -> torch.Tensor:
            t = mine.clone()
            dist.all_reduce(t, op=op, group=g)
            return t

        return run

    def all_gather(g: dist.ProcessGroup) -> torch.Tensor:
        out = torch.empty(n * NUMEL, dtype=dtype, device=device)
        dist.all_gather_into_tensor(out, mine, group=g)
        return out

    def reduce_scatter(g: dist.ProcessGroup) -> torch.Tensor:
        out = torch.empty(NUMEL // n, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, mine[: (NUMEL // n) * n].clone(), group=g)
        return out

    def broadcast(g: dist.ProcessGroup) -> torch.Tensor:
        t = mine.clone()
        dist.broadcast(t, src=ranks[-1], group=g)
        return t

    def ring(g: dist.ProcessGroup) -> torch.Tensor:
        # Send to the next rank and receive from the previous one, both posted together.
        got = torch.empty_like(mine)
        nxt, prev = ranks[(pos + 1) % n], ranks[(pos - 1) % n]
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, mine, nxt, g), dist.P2POp(dist.irecv, got, prev, g)]
        )
        for w in works:
            w.wait()
        return got

    def send_recv(g: dist.ProcessGroup) -> torch.Tensor:
        # The first rank sends to the last; others (and a one-rank group) keep their input.
        got = mine.clone()
        if n > 1 and pos == 0:
            dist.send(mine, ranks[-1], group=g)
        elif n > 1 and pos == n - 1:
            dist.recv(got, ranks[0], group=g)
        return got

    def barrier(g: dist.ProcessGroup) -> torch.Tensor:
        dist.barrier(group=g)
        return mine

    chunk = NUMEL // n
    total = every.sum(0)
    return {
        "all_reduce sum": (all_reduce("sum"), total),
        "all_reduce avg": (all_reduce("avg"), total / n),
        "all_reduce max": (all_reduce("max"), every.max(0).values),
        "all_gather_into_tensor": (all_gather, every.reshape(-1)),
        "reduce_scatter_tensor": (reduce_scatter, total[pos * chunk : (pos + 1) * chunk]),
        "broadcast": (broadcast, every[-1]),
        "batch_isend_irecv ring": (ring, every[(pos - 1) % n]),
        "send/recv": (send_recv, every[0] if n > 1 and pos == n - 1 else every[pos]),
        "barrier": (barrier, every[pos]),
    }


def compare(
    group: dist.ProcessGroup,
    reference: dist.ProcessGroup,
    device: torch.device,
    label: str,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
    repeats: int = 3,
) -> list[Check]:
    """One check per op and dtype: ``group``'s result against the exact expected values (and
    the reference group's), its time over the reference's. Every member calls it."""
    me = dist.get_rank()
    results = []
    for dtype in dtypes:
        for run, want in _ops(group.ranks, me, dtype, device).values():
            mine, theirs = run(group), run(reference)
            err = relative_error(mine, want)
            ref_err = relative_error(theirs, want)
            ratio = timed(lambda r=run: r(group), repeats) / max(
                timed(lambda r=run: r(reference), repeats), 1e-9
            )
            results.append([err, ref_err, ratio])
    # The same verdict on every rank: the largest error over ranks (time ratios: rank 0's).
    errors = torch.tensor([[e, r] for e, r, _ in results], dtype=torch.float64)
    errors = torch.nan_to_num(errors, nan=float("inf")).to(device)
    dist.all_reduce(errors, op="max", group=reference)
    errors = errors.cpu()
    checks, i = [], 0
    for dtype in dtypes:
        for name in _ops(group.ranks, me, dtype, device):
            err, ref_err = errors[i].tolist()
            what = f"{group.size()} rank(s), torch's {ref_err:.1e}; "
            dt = str(dtype).removeprefix("torch.")
            checks.append(
                judged(f"{label} {name} {dt}", err, TOLERANCE[dtype], results[i][2], AVOID, what)
            )
            i += 1
    return checks
