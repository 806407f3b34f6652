"""Runs a function in N fresh processes set up as torchrun sets up its workers (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), with a timeout: a hang or a crash is an
error with a message, never a stuck caller. Tests and ``megart-bench --nproc`` use it."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

from megart.errors import MegartError, PortInUseError


class LaunchError(MegartError):
    """A rank raised, crashed, or did not finish in time."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables torchrun gives worker ``rank`` of ``nproc`` on this machine: for starting
    ranks as plain processes (one ``python`` per rank, no launcher to clean up after them)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


class _Stdio:
    """The launcher's stdout and stderr, handed to a rank as file descriptors when it starts: a
    rank forked by the fork server would otherwise write where the server's were when it
    started (under pytest, the capture of whichever test started it)."""

    def __init__(self, fds: tuple[Any, Any] | None = None) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Stdio, ((reduction.DupFd(1), reduction.DupFd(2)),))

    def adopt(self) -> None:
        if self.fds is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), self.fds, strict=True):
            handed = fd.detach()
            os.dup2(handed, target)
            os.close(handed)


def _worker(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    env: dict[str, str],
    results: mp.Queue,
    stdio: _Stdio,
) -> None:
    stdio.adopt()
    # The caller's environment as it is now, not the fork server's (a copy of the caller's when
    # the session's first launch started the server): torchrun's workers, too, see the agent's.
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    # These ranks serve their own store (rank 0). Launched from a torchrun worker, they would
    # inherit its agent's variables, and TORCHELASTIC_USE_AGENT_STORE would have them wait on
    # an agent store that nobody serves at their MASTER_PORT (seen: megart selftest under
    # torchrun, hung until the timeout).
    for name in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        del os.environ[name]
    # Unpickling ``fn`` may already have imported torch, and OpenMP reads OMP_NUM_THREADS only
    # when it loads: its pool would have the machine's size. Set the count explicitly.
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        # Plain pickle, not the queue's: torch would share returned tensors through file
        # descriptors that die with this process before the launcher reads them.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except PortInUseError:
        results.put((rank, _PORT_TAKEN, traceback.format_exc()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the launcher
        results.put((rank, False, traceback.format_exc()))


# Modules every rank imports. Where the platform can fork, one server process imports them once
# and forks each rank from it: a rank then starts in milliseconds, not the seconds that importing
# torch takes (most of a short multi-rank test). The server only imports, so it holds no threads,
# no CUDA context and no communicator a fork could copy; everything a rank's environment decides
# (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, MASTER_PORT...) is read after the fork.
_PRELOAD = ["torch", "megart.training.trainer"]


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


# A rank's report that rank 0 found MASTER_PORT held (PortInUseError): the port free_port()
# picked was free when picked, and nothing stops another process (an outgoing connection's
# ephemeral port, often) from taking it before rank 0 binds it. Seen once, on a machine of
# 16 cores running NCCL tests. The launcher then starts the ranks again on another port.
_PORT_TAKEN = "port taken"
_PORT_TRIES = 3


class _PortTaken(Exception):
    pass


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Calls ``fn(*args)`` on ranks 0..nproc-1, each in a new process; returns their results in
    rank order. ``fn`` must be importable (a module-level function). Raises LaunchError naming
    the rank and its traceback when one fails, or the ranks still running after ``timeout``
    seconds; every process is ended before this returns. When rank 0 finds the port it was
    given taken, the ranks start again on a new one (up to three tries), unless ``env`` names
    the MASTER_PORT."""
    chosen = env is not None and "MASTER_PORT" in env
    for attempt in range(1, _PORT_TRIES + 1):
        try:
            return _launch_once(
                fn, nproc, args, timeout, {"MASTER_PORT": str(free_port()), **(env or {})}
            )
        except _PortTaken as e:
            if chosen or attempt == _PORT_TRIES:
                raise LaunchError(str(e)) from None
    raise AssertionError("unreachable")


def _launch_once(
    fn: Callable[..., Any], nproc: int, args: tuple, timeout: float, env: dict[str, str]
) -> list[Any]:
    ctx = _context()
    results: mp.Queue = ctx.Queue()
    base = {
        **os.environ,
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        # Ranks share the machine's cores, as torchrun's workers do; OpenMP and MKL keep
        # the thread count fixed (MKL may otherwise vary it, and with it rounding).
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)),
        "MKL_DYNAMIC": "FALSE",
        **env,
    }
    procs = [
        ctx.Process(target=_worker, args=(fn, args, r, base, results, _Stdio()), daemon=True)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, Any] = {}
    failure: str | None = None
    port_taken = False
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < nproc and failure is None:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(nproc)) - set(outcome))
                failure = (
                    f"rank(s) {missing} did not finish within {timeout:.0f} s "
                    "(a hang, or a peer that never arrived)"
                )
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                # Gone without a result: a crash, a kill, or os._exit. (A result put just
                # before exiting is already in the queue, so an empty queue means none.)
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in outcome and p.exitcode is not None and results.empty()
                ]
                if dead:
                    failure = "; ".join(
                        f"rank {r} exited with code {procs[r].exitcode} without reporting"
                        for r in dead
                    )
                continue
            if ok is True:
                outcome[rank] = pickle.loads(value)
            else:
                failure = f"rank {rank} raised:\n{value}"
                port_taken = ok == _PORT_TAKEN
    finally:
        for p in procs:
            p.join(timeout=0 if failure else 5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if port_taken:
        raise _PortTaken(failure)
    if failure is not None:
        raise LaunchError(failure)
    return [outcome[r] for r in range(nproc)]
