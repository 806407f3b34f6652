"""Ranks of launched nccl tests (module level, so spawn can import them). Run on one H200
(2026-11-26): the tests that use them pass there.

Several ranks on ONE GPU: NCCL refuses two ranks of a communicator on one device ("Duplicate GPU
detected", ncclInvalidUsage) when it sees them on one host. Each rank here names its own host
with NCCL_HOSTID, so NCCL takes them for ranks of different machines and connects them through
its socket transport (slow, but every code path of megart's transport is the same). This is a
test set-up only, reported to work by people testing NCCL on one-GPU machines."""

from __future__ import annotations

import gc
import os

import torch

import megart.distributed as dist


def _init_on_gpu_0(timeout: float) -> torch.device:
    rank = os.environ["RANK"]
    os.environ["LOCAL_RANK"] = "0"  # the launcher sets LOCAL_RANK = RANK; there is one GPU
    os.environ["NCCL_HOSTID"] = f"megart-test-rank-{rank}"
    os.environ.setdefault("NCCL_SHM_DISABLE", "1")
    os.environ.setdefault("NCCL_P2P_DISABLE", "1")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # both "hosts" are this machine
    dist.init(backend="nccl", timeout=timeout)
    return torch.device("cuda", 0)


def collectives_and_exchange() -> dict:
    """Every collective against a local reference, an exchange with both neighbours in one
    batch, then a clean shutdown (ncclCommFinalize and ncclCommDestroy on every rank)."""
    dev = _init_on_gpu_0(timeout=60)
    r, w = dist.get_rank(), dist.get_world_size()
    parts = [torch.arange(1000, dtype=torch.float32) + q for q in range(w)]
    t = parts[r].to(dev)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), sum(parts)), "all_reduce sum"
    t = parts[r].to(dev)
    dist.all_reduce(t, op="avg")
    torch.testing.assert_close(t.cpu(), sum(parts) / w)
    out = torch.empty(w * 1000, device=dev)
    dist.all_gather_into_tensor(out, parts[r].to(dev))
    assert torch.equal(out.cpu(), torch.cat(parts)), "all_gather"
    mine = torch.empty(1000 // w, device=dev)
    dist.reduce_scatter_tensor(mine, parts[r][: (1000 // w) * w].to(dev))
    total = sum(p[: (1000 // w) * w] for p in parts)
    assert torch.equal(mine.cpu(), total[r * (1000 // w) : (r + 1) * (1000 // w)]), "rs"
    b = parts[r].to(dev)
    dist.broadcast(b, src=w - 1)
    assert torch.equal(b.cpu(), parts[w - 1]), "broadcast"
    # Both directions of a ring in one batch, large enough to outgrow NCCL's buffers.
    n = 1 << 22
    send_next = torch.full((n,), float(r), device=dev)
    send_prev = torch.full((n,), float(-r), device=dev)
    from_prev, from_next = torch.empty(n, device=dev), torch.empty(n, device=dev)
    nxt, prv = (r + 1) % w, (r - 1) % w
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, send_next, nxt),
            dist.P2POp(dist.isend, send_prev, prv),
            dist.P2POp(dist.irecv, from_prev, prv),
            dist.P2POp(dist.irecv, from_next, nxt),
        ]
    )
    for work in works:
        work.wait()
    assert torch.all(from_prev == float(prv)) and torch.all(from_next == float(-nxt)), "ring"
    dist.barrier()
    sent = dist.bytes_sent()
    dist.destroy()
    gc.collect()  # the communicator's destructor: finalize, then destroy
    return sent


def train_on_gpu_0(kw: dict) -> list[dict]:
    """train_workers.train (the tiny GPT, 3 iterations, float32) with ``kw`` as TrainConfig
    fields, this rank on GPU 0 and megart's nccl transport between the ranks: the trainer's
    tensor-, pipeline- and data-parallel communication through real NCCL on real streams."""
    import train_workers as tw

    _init_on_gpu_0(timeout=120)
    history = tw.train(**kw)
    dist.destroy()
    gc.collect()
    return history
