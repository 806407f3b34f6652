"""Chaos: a random rank of a pp2 x dp2 job is killed (SIGKILL) at a random moment, from group
creation through the first iterations to steady state, with no torchrun or launcher to clean
up. Every survivor must notice within a few seconds (its timeout is far longer), exit with an
error naming a rank that exited (the victim, or the victim as the first to fail), and no
shared-memory segment of the job may outlive it."""

from __future__ import annotations

import glob
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from megart.distributed.rendezvous import host_file
from megart.launcher import free_port, rank_env

WORLD = 4
TIMEOUT_S = 120  # the job's --distributed-timeout: a survivor that waits it out fails the test
NOTICE_S = 10.0  # survivors notice the death this soon (0.1-4.2 s measured at load 14 on 2 cores)
EXIT_S = 30.0  # and have exited this soon (interpreter shutdown takes seconds under load)
TRIALS = int(os.environ.get("MEGART_CHAOS_TRIALS", "4"))
WORKER = str(Path(__file__).with_name("chaos_workers.py"))


def _start(port: int) -> list[subprocess.Popen]:
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, **rank_env(r, WORLD, port), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, str(TIMEOUT_S), "30"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _trial(rng: random.Random, delays: list[float]) -> None:
    port = free_port()
    procs = _start(port)
    try:
        for p in procs:  # every rank has joined (posted its pid): the kill window opens
            assert p.stdout.readline().strip() == "joined", p.stderr.read()
        victim = rng.randrange(WORLD)
        time.sleep(rng.uniform(0.0, 1.5))
        procs[victim].send_signal(signal.SIGKILL)
        killed_at, killed_wall = time.monotonic(), time.time()
        procs[victim].wait()
        named: list[str] = []
        for r, p in enumerate(procs):
            if r == victim:
                continue
            left = killed_at + EXIT_S - time.monotonic()
            try:
                p.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGUSR1)  # its Python stacks, to stderr
                time.sleep(1)
                p.kill()
                raise AssertionError(
                    f"rank {r} still runs {EXIT_S} s after rank {victim} was killed:\n"
                    + p.communicate()[1][-3000:]
                ) from None
            err = p.stderr.read()
            assert p.returncode != 0, f"rank {r} finished although rank {victim} died"
            # Each names a rank that exited: the victim, or a survivor that failed after it.
            assert "has exited" in err, err[-2000:]
            noticed = float(err.rsplit("noticed-at ", 1)[1].split()[0]) - killed_wall
            assert noticed < NOTICE_S, f"rank {r} noticed after {noticed:.1f} s: {err[-2000:]}"
            delays.append(noticed)
            named.append(err)
        # Whoever noticed first named the victim, directly or as the rank that failed first.
        assert any(f"global rank {victim} (" in e for e in named), named
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    leaked = [f for p in procs for f in glob.glob(f"/dev/shm/megart-{p.pid}-*")]
    assert not leaked, f"segments left behind: {leaked}"
    # Rank 0's note of who serves the store goes once every rank has joined.
    assert not host_file("127.0.0.1", port).exists()


def test_a_killed_rank_ends_every_survivor_within_seconds():
    rng = random.Random(int(os.environ.get("MEGART_CHAOS_SEED", "17")))
    delays: list[float] = []
    for _ in range(TRIALS):
        _trial(rng, delays)
    print(f"survivors noticed after {min(delays):.2f}-{max(delays):.2f} s")
