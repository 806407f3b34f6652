"""megart.distributed on the shm transport, with real processes (2 and 4 ranks)."""

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_workers as w
import megart.distributed as dist
from megart import ConfigError, launcher
from megart.distributed import rendezvous
from megart.errors import PortInUseError
from megart.launcher import LaunchError, free_port, launch


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_op_and_dtype_is_exact(nproc):
    assert launch(w.every_op_and_dtype, nproc, timeout=300) == [21] * nproc


def test_subgroups_and_async_ops_waited_in_reverse():
    assert launch(w.subgroups_and_async_in_reverse, 4, timeout=120) == [
        [0, 2],
        [1, 3],
        [0, 2],
        [1, 3],
    ]


@st.composite
def p2p_plans(draw):
    nproc = draw(st.sampled_from([2, 4]))
    pair = st.tuples(st.integers(0, nproc - 1), st.integers(0, nproc - 1))
    plan = draw(
        st.lists(
            st.tuples(
                pair,
                st.sampled_from([0, 1, 7, 1000, 3_000_001]),
                st.sampled_from(["float32", "bfloat16", "int64", "uint8"]),
            ),
            min_size=1,
            max_size=12,
        )
    )
    return nproc, [(s, d, n, t) for (s, d), n, t in plan], draw(st.integers(1, 3))


@settings(max_examples=6, deadline=None)
@given(p2p_plans())
def test_random_batches_of_point_to_point_ops(case):
    nproc, plan, batches = case
    sent = launch(w.p2p_plan, nproc, plan, batches, timeout=90)
    # The byte counters saw exactly the payloads each rank sent.
    for rank, per_peer in enumerate(sent):
        expect = {}
        for src, dst, n, dtype in plan:
            if src == rank:
                expect[dst] = expect.get(dst, 0) + n * getattr(torch, dtype).itemsize
        assert per_peer == {k: v for k, v in expect.items() if v}


def test_a_peer_that_exits_is_named_quickly():
    result, left = launch(w.peer_exits_mid_collective, 2, timeout=60)
    assert left == "left"
    seconds, message = result.split("|", 1)
    assert float(seconds) < 10, "the dead peer should be noticed long before the timeout"
    assert "rank 1 (pid" in message and "has exited" in message
    assert "rank 0 of group 'world'" in message and "all_reduce(10 x float32, sum)" in message


def test_a_stuck_peer_times_out_with_a_message():
    message = launch(w.peer_stuck_past_timeout, 2, timeout=60)[0]
    assert "timed out after 1500 ms waiting for global rank 1" in message
    assert "all_reduce" in message and "group 'world'" in message


def test_abort_unblocks_the_other_ranks():
    message, status = launch(w.abort_unblocks_the_others, 2, timeout=60)
    assert status == "aborted"
    assert "aborted by rank 1" in message and "recv(4 x float32 from rank 1)" in message


def test_ranks_that_disagree_get_errors_not_garbage():
    errors = launch(w.mismatched_calls, 2, timeout=60)
    assert "another collective" in errors[0][0]
    assert "the group failed earlier" in errors[0][1]
    assert (
        "rank 0 sent 16 bytes of float32 but recv(5 x float32 from rank 0) expects 20"
        in (errors[1][2])
    )


def test_ops_between_two_ranks_grouped_differently_are_refused():
    """What NCCL requires and leaves undefined otherwise: both ranks of a pair batch their
    messages alike. The shm transport checks each message's batch against the receiver's."""
    errors = launch(w.mismatched_grouping, 2, timeout=60)
    assert "rank 0 grouped its messages with this rank differently" in errors[1]
    assert "1 send(s) to it and 1 receive(s) from it" in errors[1]
    assert errors[0] != "no error"  # its receive fails too (the peer gave up), not a hang


def test_launcher_reports_a_raising_rank_and_a_hang():
    with pytest.raises(LaunchError, match="rank 1 raised"):
        launch(_raise_on_rank_1, 2, timeout=60)
    # Long enough for a loaded 2-core machine to start rank 1 (importing torch takes seconds).
    with pytest.raises(LaunchError, match=r"rank\(s\) \[0\] did not finish within 20 s"):
        launch(_hang_on_rank_0, 2, timeout=20)
    with pytest.raises(LaunchError, match="rank 1 exited with code 0 without reporting"):
        launch(_vanish_on_rank_1, 2, timeout=60)


def _join_the_world():
    dist.init(backend="shm", timeout=60)
    rank = dist.get_rank()
    dist.destroy()
    return rank


def test_a_master_port_taken_before_rank_0_binds_it_is_named_and_the_launcher_moves_on(
    monkeypatch,
):
    """free_port()'s port is free only when picked: another process may bind it first (seen
    once on a 16-core machine running NCCL tests). Rank 0 says so at once, naming the port, and
    the launcher starts the ranks again on another one, unless the caller chose the port."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken))
        start = time.monotonic()
        with pytest.raises(PortInUseError, match=f"MASTER_PORT {taken} is already in use"):
            rendezvous.connect(0, 2, timedelta(seconds=60))
        assert time.monotonic() - start < 10  # not after the timeout
        picks = iter([taken])
        monkeypatch.setattr(launcher, "free_port", lambda: next(picks, free_port()))
        assert launch(_join_the_world, 2, timeout=60) == [0, 1]
        assert next(picks, None) is None  # the held port was tried first
        with pytest.raises(LaunchError, match=f"(?s)rank 0 raised.*MASTER_PORT {taken} is already"):
            launch(_join_the_world, 2, timeout=60, env={"MASTER_PORT": str(taken)})
    finally:
        held.close()


def _threads():
    import torch

    return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


def test_launched_ranks_share_the_cores_and_an_env_overrides_the_threads():
    cores = os.cpu_count() or 1
    for nproc in (1, 2, 4):
        expect = max(1, cores // nproc)
        assert launch(_threads, nproc, timeout=60) == [(expect, str(expect))] * nproc
    assert launch(_threads, 2, timeout=60, env={"OMP_NUM_THREADS": "3"}) == [(3, "3")] * 2


def _variables(*names):
    return [os.environ.get(n) for n in names]


def test_ranks_see_the_launchers_environment_of_the_moment(monkeypatch):
    """Ranks forked by a server started earlier see the variables the launcher has now (set,
    changed or removed since), as torchrun's workers see their agent's: CUDA_VISIBLE_DEVICES
    decides whether a rank finds a GPU."""
    names = ("MEGART_TEST_SET_LATER", "MEGART_TEST_REMOVED", "CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("MEGART_TEST_REMOVED", "here")
    launch(_variables, 1, timeout=60)  # the first call may start the server
    monkeypatch.setenv("MEGART_TEST_SET_LATER", "1")
    monkeypatch.delenv("MEGART_TEST_REMOVED")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launch(_variables, 2, *names, timeout=60) == [["1", None, ""]] * 2


def _print_rank():
    print(f"hello from rank {os.environ['RANK']}", flush=True)
    print(f"warning from rank {os.environ['RANK']}", file=sys.stderr, flush=True)


def test_ranks_write_to_the_launchers_stdout_and_stderr_of_the_moment(tmp_path):
    """Ranks forked by a server started earlier write where the launcher's output goes now,
    not where it went when the server started."""
    saved = os.dup(1), os.dup(2)
    try:
        for name in ("before", "now"):
            with open(tmp_path / name, "w") as f:
                os.dup2(f.fileno(), 1)
                os.dup2(f.fileno(), 2)
                launch(_print_rank, 2, timeout=60)  # the first call may start the server
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    now = (tmp_path / "now").read_text()
    for r in (0, 1):
        assert now.count(f"hello from rank {r}") == 1
        assert now.count(f"warning from rank {r}") == 1


def test_a_launcher_inside_a_torchrun_worker_starts_ranks_that_serve_their_own_store():
    """A torchrun worker's environment names its agent's store; ranks launched from it (as
    megart selftest does under torchrun) serve their own, and must not wait on the agent's."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import dist_workers as w; "
        "from megart.launcher import launch; "
        "print(launch(w.world_and_agent_variable, 2, timeout=60))"
    )
    torchrun_worker = {"TORCHELASTIC_USE_AGENT_STORE": "true", "TORCHELASTIC_RESTART_COUNT": "0"}
    run = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(__file__)],
        env={**os.environ, **torchrun_worker},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "[(2, None), (2, None)]"


def _raise_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise RuntimeError("boom")


def _vanish_on_rank_1():
    import os
    import time

    if os.environ["RANK"] == "1":
        os._exit(0)
    time.sleep(60)


def _hang_on_rank_0():
    import os
    import time

    if os.environ["RANK"] == "0":
        time.sleep(60)


@pytest.fixture
def one_process_world():
    dist.init(backend="shm")
    yield
    dist.destroy()


def test_bad_tensors_are_refused_before_anything_is_sent(one_process_world):
    with pytest.raises(ConfigError, match="not contiguous"):
        dist.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(ConfigError, match="complex64 cannot be communicated"):
        dist.all_reduce(torch.ones(4, dtype=torch.complex64))
    with pytest.raises(ConfigError, match=r"must hold group size \(1\) x input \(4\) = 4"):
        dist.all_gather_into_tensor(torch.empty(5), torch.ones(4))
    with pytest.raises(ConfigError, match="reduction 'prod' is not supported"):
        dist.all_reduce(torch.ones(4), op="prod")
    with pytest.raises(ConfigError, match="rank 3 is not in group 'world'"):
        dist.send(torch.ones(1), dst=3)
    with pytest.raises(ConfigError, match="unknown backend 'mpi'"):
        dist.destroy()
        dist.init(backend="mpi")


def test_one_process_world_works_without_torchrun(one_process_world):
    t = torch.arange(6.0)
    dist.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    assert t.tolist() == list(range(6))
    x, y = torch.arange(3.0), torch.empty(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, y, 0)])
    for wk in works:
        wk.wait()
    assert torch.equal(x, y)  # send to self
    assert dist.bytes_sent() == {0: 12}
