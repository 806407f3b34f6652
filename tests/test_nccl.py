"""The nccl transport. On machines without a GPU (CI) only the parts that need none run: the
loader's error, the `_cuda` module sharing `_core`'s classes, the Python-side tensor checks and
tensor lifetimes (megart's declarations of NCCL's API against nccl.h, and an installed NCCL's
symbols: test_nccl_declarations.py). The GPU tests run a one-rank NCCL world (NCCL refuses two
ranks on one GPU); they are skipped without CUDA; on one H200 (2026-11-26) they all passed."""

import gc
import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

import megart.distributed as dist
from megart import _core
from megart.distributed import find_nccl, nccl_candidates
from megart.distributed.group import ProcessGroup
from megart.errors import CommTimeoutError, ConfigError, MegartError

HAS_CUDA_MODULE = importlib.util.find_spec("megart._cuda") is not None
needs_cuda_module = pytest.mark.skipif(not HAS_CUDA_MODULE, reason="megart built without CUDA")
needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_CUDA_MODULE and find_nccl() is not None),
    reason="needs a GPU, megart._cuda and NCCL",
)
pytestmark = pytest.mark.gpu_ranks  # its subprocesses and launched ranks use the GPU


@pytest.fixture
def no_world():
    dist.destroy()
    yield
    dist.destroy()


def _nccl_elsewhere():
    """NCCL that megart would find without MEGART_NCCL_LIBRARY (a wheel, torch's, the system's)."""
    env = {k: v for k, v in os.environ.items() if k != "MEGART_NCCL_LIBRARY"}
    code = "from megart.distributed import find_nccl; print(find_nccl() is not None)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    return out.stdout.strip() == "True"


@pytest.mark.skipif(
    _nccl_elsewhere() or "MEGART_NCCL_LIBRARY" in os.environ,
    reason="NCCL is installed here: init would find it (by its soname once it is loaded)",
)
def test_init_nccl_without_nccl_raises_the_loaders_error(monkeypatch, tmp_path, no_world):
    missing = tmp_path / "nowhere" / "libnccl.so.2"
    monkeypatch.setenv("MEGART_NCCL_LIBRARY", str(missing))
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert nccl_candidates()[0] == str(missing)
    with pytest.raises(MegartError, match="NCCL was not found") as info:
        dist.init(backend="nccl")
    message = str(info.value)
    assert str(missing) in message and "libnccl.so.2" in message  # every candidate, and why
    assert not dist.is_initialized()


@needs_cuda_module
def test_cuda_module_shares_cores_classes_and_errors():
    """`_cuda` imports `_core` and uses its registered Communicator and error types: an error
    raised in `_cuda`'s C++ arrives as `_core`'s Python exception class."""
    from megart import _cuda

    # pybind11 writes a return type it knows by its Python name, one it does not by its C++
    # name: `_cuda` sees the class that `_core` registered.
    assert "-> megart._core.comm.Communicator" in _cuda.create_nccl.__doc__
    with pytest.raises(ConfigError, match="unique id must be 128 bytes, not 3"):
        _cuda.create_nccl("libnccl.so.2", b"abc", 0, 1, 0, 1.0, "g")
    with pytest.raises(MegartError, match="NCCL was not found"):
        _cuda.nccl_unique_id("/nowhere/libnccl.so.2")
    assert hasattr(_core.comm.Work, "wait_stream")


class _NeverCalled:
    def __getattr__(self, name):
        raise AssertionError(
            f"the communicator was called ({name}) before the tensors were checked"
        )


def test_nccl_group_refuses_cpu_tensors_before_anything_is_sent():
    g = ProcessGroup([0], "fake-nccl", "nccl", comm=_NeverCalled(), device=0)
    with pytest.raises(ConfigError, match=r"is on cpu, but group 'fake-nccl' uses the nccl"):
        dist.all_reduce(torch.ones(4), group=g)
    with pytest.raises(ConfigError, match="moves GPU memory; move it to cuda:0"):
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(4), group=g)
    with pytest.raises(ConfigError, match="nccl transport"):
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 0, g)])


def test_shm_group_still_refuses_non_cpu_tensors():
    g = ProcessGroup([0], "fake-shm", "shm", comm=_NeverCalled())
    with pytest.raises(ConfigError, match="use CPU tensors"):
        dist.all_reduce(torch.ones(4, device="meta"), group=g)


def test_shm_work_wait_stream_waits_on_the_host(no_world):
    dist.init(backend="shm")
    t = torch.ones(3)
    w = dist.all_reduce(t, async_op=True)
    w.wait_stream()  # host memory: nothing to order on a device, so it waits
    assert w.is_completed() and t.tolist() == [1.0, 1.0, 1.0]


class _StuckWork:
    def is_completed(self):
        return False


class _AbortRecorder:
    aborted = False

    def abort(self):
        self.aborted = True


def test_an_op_in_flight_past_the_timeout_aborts_the_group_at_its_next_use(no_world):
    """nccl ops ordered on the stream keep their tensors in the group until they complete; one
    that is still running after the timeout fails the group instead of hanging a later sync."""
    from megart.distributed.work import _keep_until_done

    dist.init(backend="shm", timeout=0.2)
    comm = _AbortRecorder()
    g = ProcessGroup([0], "fake-nccl", "nccl", comm=comm, device=0)
    _keep_until_done(g, _StuckWork(), [torch.ones(1)])
    _keep_until_done(g, _StuckWork(), [torch.ones(1)])  # young: kept
    assert len(g.in_flight) == 2 and not comm.aborted
    time.sleep(0.3)
    with pytest.raises(CommTimeoutError, match="group 'fake-nccl' has not completed after"):
        _keep_until_done(g, _StuckWork(), [torch.ones(1)])
    assert comm.aborted


class _UnfinishedWork:
    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


def test_an_unwaited_nccl_work_leaves_its_tensors_to_the_group():
    """A Work dropped before its op finished (an isend never waited on) must not free its
    tensors: NCCL may still use them, and the caching allocator would hand the memory out."""
    from megart.distributed.work import Work, _keep

    g = ProcessGroup([0], "fake-nccl", "nccl", comm=_NeverCalled(), device=0)
    work, t = _UnfinishedWork(), torch.ones(3)
    Work(work, [t], g)  # dropped at once
    gc.collect()
    assert len(g.in_flight) == 1 and g.in_flight[0][1][0] is t
    work.done = True
    _keep(g, _UnfinishedWork(), [], 0.0)  # the next op lets the completed one go
    assert len(g.in_flight) == 1 and g.in_flight[0][1] == []
    g.in_flight.clear()
    waited = Work(_UnfinishedWork(), [torch.ones(1)], g)
    waited._tensors = []  # what wait() leaves: nothing to keep
    del waited
    shm = ProcessGroup([0], "fake-shm", "shm", comm=_NeverCalled())
    Work(_UnfinishedWork(), [torch.ones(1)], shm)  # host ops finish before they return
    assert g.in_flight == [] and shm.in_flight == []


# ---- on a GPU (all passed on one H200, 2026-11-26) ----


@pytest.fixture
def nccl_world(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    dist.destroy()
    dist.init(backend="nccl", timeout=30)
    yield
    dist.destroy()


@needs_gpu
def test_one_rank_collectives(nccl_world):
    dev = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = torch.arange(8, device=dev).to(dtype)
        dist.all_reduce(t)
        assert torch.equal(t.cpu(), torch.arange(8).to(dtype))
    t = torch.arange(8.0, device=dev)
    dist.all_reduce(t, op="avg")
    dist.all_reduce(t, op="max")
    assert t.tolist() == list(range(8))
    out = torch.empty(5, device=dev)
    dist.all_gather_into_tensor(out, torch.arange(5.0, device=dev))
    assert out.tolist() == list(range(5))
    rs = torch.empty(5, device=dev)
    dist.reduce_scatter_tensor(rs, torch.arange(5.0, device=dev))
    assert rs.tolist() == list(range(5))
    b = torch.full((4,), 3.0, device=dev)
    dist.broadcast(b, src=0)
    assert b.tolist() == [3.0] * 4
    dist.barrier()


@needs_gpu
def test_one_rank_self_send_recv_in_a_batch(nccl_world):
    dev = torch.device("cuda", torch.cuda.current_device())
    x, y = torch.arange(6.0, device=dev), torch.zeros(6, device=dev)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, y, 0)])
    for w in works:
        w.wait()
    assert torch.equal(x, y)
    assert dist.bytes_sent() == {0: 24}


@needs_gpu
def test_inputs_on_the_callers_stream_and_wait_stream_ordering(nccl_world):
    """The op waits for the caller's stream (the input is written there just before), and
    wait_stream orders a second stream after the op without the host waiting."""
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        big = torch.randn(1 << 22, device=dev)
        t = torch.zeros(1 << 22, device=dev)
        torch.cuda._sleep(10_000_000)  # keeps `side` busy so an unordered op would read zeros
        t.copy_(big)
        w = dist.all_reduce(t, async_op=True)
        w.wait_stream(side)
        result = t.clone()  # queued on `side` after the op
    side.synchronize()
    assert torch.equal(result, big)


@needs_gpu
def test_a_wait_that_never_completes_times_out(monkeypatch):
    """An op whose input never becomes ready (the caller's stream is held far past the
    timeout) must end its host wait with CommTimeoutError naming the op and the peer, not hang;
    the group is aborted and refuses later ops. The watchdog is off here (it would end the
    process first, as tests/test_nccl_standin.py shows), and the timeout leaves a real NCCL
    time to create the communicator."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MEGART_NCCL_WATCHDOG", "0")
    dist.destroy()
    dist.init(backend="nccl", timeout=8)
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        t = torch.ones(4, device=dev)
        torch.cuda._sleep(40_000_000_000)  # 20 s or more of the current stream at 2 GHz or less
        w = dist.all_reduce(t, async_op=True)
        with pytest.raises(CommTimeoutError, match=r"rank 0 of group 'world'.*all_reduce.*rank 0"):
            w.synchronize()
        with pytest.raises(MegartError, match="failed earlier"):
            dist.all_reduce(t)
        torch.cuda.synchronize()
    finally:
        dist.destroy()


@needs_gpu
def test_a_receive_from_self_without_its_send_is_an_error_naming_it(monkeypatch):
    """NCCL refuses a send or receive to self whose match is not in the same group
    (ncclInvalidUsage): on a non-blocking communicator that answer arrives through the state
    polled after ncclGroupEnd, and must come back as an error naming the op and its peer."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    dist.destroy()
    dist.init(backend="nccl", timeout=30)
    try:
        y = torch.zeros(4, device=torch.device("cuda", torch.cuda.current_device()))
        with pytest.raises(MegartError, match=r"rank 0 of group 'world'.*recv\(4 x float32 from"):
            dist.batch_isend_irecv([dist.P2POp(dist.irecv, y, 0)])
    finally:
        dist.destroy()


@needs_gpu
def test_creation_without_every_rank_times_out():
    """A group whose other rank never comes: creation (non-blocking with NCCL 2.14+) must end
    at the timeout with CommTimeoutError, not hang in NCCL's bootstrap."""
    from megart import _cuda

    path, version = find_nccl()
    if tuple(int(x) for x in version.split(".")[:2]) < (2, 14):
        pytest.skip("NCCL before 2.14 has only the blocking ncclCommInitRank")
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 0 of group 'lonely'.*not every rank"):
        _cuda.create_nccl(path, _cuda.nccl_unique_id(path), 0, 2, 0, 2.0, "lonely")
    assert time.monotonic() - start < 60


@needs_gpu
def test_two_ranks_on_one_gpu():
    """Two processes share the GPU as two NCCL ranks (NCCL_HOSTID per rank, see
    nccl_workers.py): the unique id through the TCPStore, every collective, a batched ring
    exchange both ways, the byte counters and a clean shutdown on both ranks."""
    import nccl_workers
    from megart.launcher import launch

    sent = launch(nccl_workers.collectives_and_exchange, 2, timeout=300)
    ring = 2 * (1 << 22) * 4  # both directions of the ring go to the one other rank
    assert sent == [{0: 0, 1: ring}, {0: ring, 1: 0}]  # bytes_sent counts every rank, self too


# ---- the Python side of the nccl transport, with fakes of its C++ Work ----


class _RecordingWork:
    def __init__(self):
        self.calls = []

    def wait(self):
        self.calls.append("host wait")

    def wait_stream(self, stream):
        self.calls.append(("wait_stream", stream))

    def is_completed(self):
        return False


def test_nccl_work_wait_orders_the_current_stream_and_leaves_the_host_free(monkeypatch, no_world):
    """torch.distributed's work.wait(): on a device transport the current stream waits for the
    op; the host is blocked only by synchronize(). The pipeline engine, gradient buckets and
    distributed optimizer call wait(), so on a GPU they never stall the host between kernels."""
    import megart.distributed.ops as ops
    import megart.distributed.work as work_module

    class _Stream:
        cuda_stream = 1234

    monkeypatch.setattr(work_module, "current_stream", lambda device: _Stream())
    dist.init(backend="shm")  # the context (timeout) the fake nccl group's Works read
    g = ProcessGroup([0], "fake-nccl", "nccl", comm=_NeverCalled(), device=0)
    work, t = _RecordingWork(), torch.ones(2)
    w = ops.Work(work, [t], g)
    w.wait()
    assert work.calls == [("wait_stream", 1234)]
    assert len(g.in_flight) == 1 and g.in_flight[0][1][0] is t  # kept until done on the device
    w2 = ops.Work(_RecordingWork(), [], g)
    w2.synchronize()
    assert w2._work.calls == ["host wait"]
    host = ops.Work(_RecordingWork(), [torch.ones(1)], ProcessGroup([0], "s", "shm", comm=None))
    host.wait()
    assert host._work.calls == ["host wait"]  # host transports: done when wait returns


def test_in_flight_list_keeps_every_op_posted_from_many_threads():
    """Ops are kept from several threads at once (the training thread, the garbage collector's
    __del__): none may be lost while completed ones are let go."""
    import threading

    from megart.distributed.work import _keep

    g = ProcessGroup([0], "fake-nccl", "nccl", comm=_NeverCalled(), device=0)
    works = [[_UnfinishedWork() for _ in range(2000)] for _ in range(4)]

    def post(mine):
        for w in mine:
            _keep(g, w, [], 0.0)

    threads = [threading.Thread(target=post, args=(mine,)) for mine in works]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(g.in_flight) == 8000
    for w, _, _ in g.in_flight[:5000]:
        w.done = True
    _keep(g, _UnfinishedWork(), [], 0.0)
    assert len(g.in_flight) == 3001  # the completed front went, the rest and the new one stay
