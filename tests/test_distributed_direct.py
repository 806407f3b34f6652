"""Point-to-point messages at least a ring long (2 MiB) go by a direct read on the shm
transport: the receiver copies the payload from the sender's memory. The data must arrive
exactly whether the read happens, is turned off (MEGART_SHM_DIRECT=0), or is refused (then the
payload is streamed through the ring after all)."""

import pytest
import torch

import megart.distributed as dist
from megart.launcher import launch

RING = 2 << 20
# Bytes per message: below a ring, exactly a ring, just above, several rings and odd.
SIZES = [28, RING, RING + 4, 3 * RING + 12]


def _fill(nbytes: int, rank: int, k: int) -> torch.Tensor:
    n = nbytes // 4
    return (torch.arange(n, dtype=torch.int64) * 7 + rank * 1_000_003 + k).to(torch.int32)


def _exchange() -> tuple[list[bool], dict[int, int]]:
    dist.init(backend="shm", timeout=60)
    rank, n = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    ok = []
    for k, nbytes in enumerate(SIZES * 2):  # twice: after a refusal the peer is streamed to
        x, y = _fill(nbytes, rank, k), torch.zeros(nbytes // 4, dtype=torch.int32)
        ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        ok.append(torch.equal(y, _fill(nbytes, prv, k)))
        # Blocking send/recv, ordered so that it cannot deadlock: rank 0 sends first.
        z = torch.zeros_like(y)
        if rank == 0:
            dist.send(x, nxt)
            dist.recv(z, prv)
        else:
            dist.recv(z, prv)
            dist.send(x, nxt)
        ok.append(torch.equal(z, _fill(nbytes, prv, k)))
    sent = dist.bytes_sent()
    dist.destroy()
    return ok, sent


@pytest.mark.parametrize("setting", ["1", "0", "refuse"])
def test_large_messages_arrive_exactly_however_they_travel(setting):
    results = launch(_exchange, 2, timeout=120, env={"MEGART_SHM_DIRECT": setting})
    for ok, sent in results:
        assert all(ok)
        assert sum(sent.values()) == 2 * 2 * sum(SIZES)  # counted as sent, whatever the path
