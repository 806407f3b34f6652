"""backend="torch": megart.distributed's API over torch.distributed's groups (gloo here) gives
what the shm transport gives, op by op, on 3 real processes; and its errors are megart's."""

import pytest
import torch

import torch_backend_workers as w
from megart import ConfigError
from megart.launcher import launch


def _same(a, b, key):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, key
        if "avg" in key:  # one rounding of the division may differ between the two
            torch.testing.assert_close(a, b, msg=key)
        else:
            assert torch.equal(a, b), key
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), key
        for x, y in zip(a, b, strict=True):
            _same(x, y, key)
    else:
        assert a == b, key


def test_every_op_over_torch_equals_shm():
    shm = launch(w.every_op, 3, "shm", timeout=300)
    over_torch = launch(w.every_op, 3, "torch", timeout=300)
    for rank, (a, b) in enumerate(zip(over_torch, shm, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            _same(a[key], b[key], f"rank {rank}: {key}")
    # Independent of both: the sums and the bytes counted by point-to-point ops.
    assert torch.equal(
        shm[0]["all_reduce sum torch.int64/7"], sum(w._value(q, 7, torch.int64) for q in range(3))
    )
    assert shm[0]["bytes_sent"] == over_torch[0]["bytes_sent"] == {0: 0, 1: 0, 2: 80}
    assert torch.equal(
        over_torch[2]["send/recv"], torch.cat([torch.arange(10.0), torch.arange(10.0) * 2])
    )


def test_torch_backend_refuses_gpu_tensors_and_unknown_names(one_process_torch_world):
    import megart.distributed as dist

    with pytest.raises(ConfigError, match="use one of shm, nccl, torch"):
        dist.new_group(backend="mpi")
    with pytest.raises(ConfigError, match="cannot be communicated"):
        dist.all_reduce(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ConfigError, match="not contiguous"):
        dist.all_reduce(torch.zeros(4, 4).t())
    t = torch.arange(4.0)
    dist.all_reduce(t, op="avg")  # one rank: unchanged
    assert torch.equal(t, torch.arange(4.0))


@pytest.fixture
def one_process_torch_world():
    import torch.distributed as td

    import megart.distributed as dist

    dist.init(backend="torch")
    yield
    dist.destroy()
    assert not td.is_initialized()  # megart started torch's group, so destroy() ended it


def test_destroy_lets_go_of_torch_groups_a_caller_still_holds():
    """A torch group that a caller's megart group kept past destroy() lived until the
    interpreter's shutdown, where gloo's destructor could abort a process that had finished
    cleanly (2 runs in 16 under torchrun on a loaded machine). destroy() now releases it, and
    the megart group says so when used."""
    import megart.distributed as dist
    from megart import CommError

    dist.init(backend="torch")
    groups = [dist.new_group(), dist.new_group([0])]
    dist.destroy()
    for group in groups:
        assert group.comm.pg is None
        with pytest.raises(CommError, match=r"ended with megart.distributed.destroy\(\)"):
            dist.all_reduce(torch.ones(2), group=group)


def test_a_group_used_after_destroy_is_refused_on_every_transport():
    """As torch.distributed refuses a destroyed group: an op on a group a caller kept past
    destroy() raises at once, instead of waiting on peers that have left."""
    import megart.distributed as dist
    from megart import CommError

    dist.init(backend="shm")
    world, group = dist.new_group(), dist.new_group([0])
    dist.destroy()
    dist.init(backend="shm")  # a new context does not revive the old groups
    try:
        for g in (world, group):
            with pytest.raises(CommError, match=r"ended with megart.distributed.destroy\(\)"):
                dist.all_reduce(torch.ones(2), group=g)
        t = torch.ones(2)
        dist.all_reduce(t, group=dist.new_group())
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy()


def test_an_nccl_groups_barrier_names_this_ranks_gpu(monkeypatch):
    """torch's NCCL barrier is an all-reduce on some GPU: without device_ids it takes the
    current one and warns (seen in `megart selftest` under torchrun on a GPU). megart names the
    rank's own; over gloo it passes none, as before."""
    from megart.distributed import torch_backend as tb

    calls = []
    monkeypatch.setattr(tb.td, "barrier", lambda **kw: calls.append(kw))
    monkeypatch.setattr(tb.torch.cuda, "current_device", lambda: 3)
    comm = tb.TorchComm(object(), 0, 2, "test")
    for backend in ("nccl", "gloo"):
        monkeypatch.setattr(tb.td, "get_backend", lambda pg, b=backend: b)
        comm.barrier()
    assert [c["device_ids"] for c in calls] == [[3], None]
    assert all(c["async_op"] for c in calls)
