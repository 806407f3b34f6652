"""Rank 0 serves the rendezvous store when there is no torchrun (a plain `python` per rank with
MASTER_ADDR/MASTER_PORT): if it dies, the other ranks say so within seconds instead of waiting
out the store's timeout, whether they had reached the store or not; an earlier job's rank 0
that died on the same port is not taken for this job's. Real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from megart.distributed.rendezvous import host_file
from megart.launcher import free_port

TIMEOUT_S = 60  # the job's timeout: a rank that waits it out fails the test
NOTICE_S = 20.0  # the others say rank 0 is gone this soon (2 s of it is the deliberate wait)

# Rank 0: serves the store and dies (SIGKILL, no clean-up) before the job goes further: at once,
# or once rank 1 has connected and posted its pid.
RANK0 = """
import os, signal, sys, time
from datetime import timedelta
from megart.distributed import rendezvous
store = rendezvous.connect(0, 2, timedelta(seconds=60))
print("serving", flush=True)
if sys.argv[1] == "after":
    while not store.check([rendezvous.key_prefix() + "pid/1"]):
        time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""
# Rank 1: joins once the test says so (its process started with rank 0's).
RANK1 = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
import megart.distributed as d
d.init(backend="shm", timeout=float(sys.argv[2]))
"""


def _env(rank: int, port: int) -> dict:
    return dict(
        os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


@pytest.mark.parametrize("when", ["before", "after"])
def test_rank0_dying_is_noticed_within_seconds(tmp_path, when):
    port, go = free_port(), tmp_path / "go"
    rank1 = subprocess.Popen(
        [sys.executable, "-c", RANK1, str(go), str(TIMEOUT_S)],
        env=_env(1, port),
        stderr=subprocess.PIPE,
        text=True,
    )
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0, when],
        env=_env(0, port),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank0.stdout.readline().strip() == "serving", rank0.stderr.read()
        if when == "before":  # rank 1 tries only once rank 0 is gone
            rank0.wait(timeout=60)
        go.write_text("")
        rank0.wait(timeout=60)
        died = time.monotonic()
        rank1.wait(timeout=TIMEOUT_S + 30)
        took = time.monotonic() - died
        err = rank1.stderr.read()
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert rank1.returncode != 0
    assert took < NOTICE_S, f"rank 1 took {took:.1f} s: {err[-2000:]}"
    last = err.strip().splitlines()[-1]
    assert f"rank 0 (pid {rank0.pid}), which serves" in last, err[-2000:]
    assert ("exited before rank 1 could connect" if when == "before" else "went away") in last
    assert not host_file("127.0.0.1", port).exists()  # rank 1 removed what rank 0 could not


def test_an_earlier_jobs_dead_rank0_on_the_port_is_not_taken_for_this_one():
    port = free_port()
    stale = host_file("127.0.0.1", port)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale.write_text(f"{dead.pid} {time.time() - 3600:.3f}\n")  # an hour-old job's rank 0
    try:
        code = "import megart.distributed as d; d.init(backend='shm', timeout=4)"
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=_env(1, port),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stale.unlink()
    assert out.returncode != 0
    assert "rank 1 is waiting for rank 0 to serve the rendezvous at 127.0.0.1:" in out.stderr
    assert "nothing serves the rendezvous at 127.0.0.1:" in out.stderr.strip().splitlines()[-1]
    assert "exited" not in out.stderr


def test_a_group_whose_creator_never_sets_it_up_is_named_while_waited_for(capsys):
    import torch.distributed as td

    from megart import CommTimeoutError
    from megart.distributed import group

    alive = [os.getpid(), os.getpid()]  # the creator runs but never posts the group's name
    with pytest.raises(CommTimeoutError, match=r"global rank 1 did not set it up within 2 s"):
        group._wait_key(td.HashStore(), "k", 1, alive, timedelta(seconds=2), "g")
    notices = capsys.readouterr().err.strip().splitlines()
    assert notices and all(
        n == "megart: creating group 'g': waiting for global rank 1 to set it up "
        "(gives up after 2 s)"
        for n in notices
    ), notices
