"""A rank that is alive but stuck (SIGSTOP) holds its peers in a collective: no death to
notice, so each survivor says every MEGART_WAIT_NOTICE_S seconds (60 by default; 1 here)
which rank it waits on, with its coordinates, and in which op, at most once per interval, and
gives up at the job's timeout with an error naming the stopped rank. Real processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from megart.launcher import free_port, rank_env

WORLD = 4
TIMEOUT_S = 8.0  # the job's distributed timeout
NOTICE_S = 1.0
WORKER = str(Path(__file__).with_name("stopped_rank_workers.py"))


def test_survivors_name_the_stopped_rank_until_the_timeout_ends_them():
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(TIMEOUT_S)],
            env=dict(
                os.environ,
                **rank_env(r, WORLD, port),
                OMP_NUM_THREADS="1",
                MEGART_WAIT_NOTICE_S=str(NOTICE_S),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    victim = 2  # tp 0, dp 1 under Megatron's order
    try:
        for p in procs:
            assert p.stdout.readline().startswith("joined"), p.stderr.read()
        procs[victim].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        errs = {}
        for r, p in enumerate(procs):
            if r == victim:
                continue
            try:
                p.wait(timeout=TIMEOUT_S + 60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {r} outlived its timeout") from None
            errs[r] = p.stderr.read()
            assert p.returncode != 0, errs[r]
        elapsed = time.monotonic() - stopped
    finally:
        procs[victim].send_signal(signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    name = f"global rank {victim} (tp 0, pp 0, dp 1)"
    for r, err in errs.items():
        notices = [line for line in err.splitlines() if "is still waiting on" in line]
        # Several notices, each naming this rank and the stopped one, the op and the limit.
        assert len(notices) >= 2, err[-3000:]
        assert all(
            re.match(rf"megart: global rank {r} \(tp \d, pp 0, dp \d\) is still waiting on ", n)
            for n in notices
        ), notices
        assert all(f"on {name} in all_reduce(16 x float32, sum)" in n for n in notices), notices
        assert f"gives up after {TIMEOUT_S:.0f} s" in notices[0]
        # Never more than one per interval (a blocked wait could print on every wake-up).
        assert len(notices) <= elapsed / NOTICE_S + 1, notices
        # The error that ends it names the stopped rank: waiting for it, or as the first failure.
        last = err.strip().splitlines()[-1]
        assert name in last and ("timed out" in last or "failed first" in last), err[-3000:]
