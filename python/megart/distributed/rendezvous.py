"""How the ranks of a job meet: the job's TCPStore at MASTER_ADDR:MASTER_PORT, and the exchange
of every rank's process id through it (which later waits use to notice a dead peer at once).

Without torchrun, rank 0 serves the store. If it dies, the others must not wait out the whole
timeout: rank 0 also writes a small "host file" in /dev/shm (which the shm transport already
needs shared by the job's processes) naming its pid, so a rank that cannot reach the store yet
tells "rank 0 has not started" (wait) from "rank 0 started and died" (fail within seconds); and
a rank whose store connection breaks after it connected says that rank 0 is gone. Under
torchrun the agent serves the store and cleans up after a dead worker itself.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from megart.errors import CommError, CommTimeoutError, PortInUseError, RankEnvironmentError

# How often a rank that waits at the rendezvous says whom it waits for.
NOTICE_S = 10.0
# A host file naming a dead rank 0 is believed once it has said so this long (a rank 0 that is
# just starting on the same port rewrites it), and only when written at most this long before
# this process started: an older one is an earlier job's, whose rank 0 died on this port.
_DEAD_FOR_S = 2.0
_SAME_JOB_SLACK_S = 2.0


# init() calls this process has ended with destroy(). torchrun's agent store outlives them, so
# each init after the first takes keys of its own: reading the last one's, a rank attached to
# shared memory its creator had already replaced (a hang until the timeout).
_ended_inits = 0


def key_prefix() -> str:
    """Where this job's keys live in the store: torchrun restarts workers on the same store, so
    each attempt gets its own keys, and so does each init() after a destroy()."""
    prefix = f"megart/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return prefix + (f"init{_ended_inits}/" if _ended_inits else "")


def ended_init() -> None:
    """destroy() ended an init(): the next one takes fresh keys (every rank ends alike)."""
    global _ended_inits
    _ended_inits += 1


def under_agent() -> bool:
    """Whether torchrun's agent serves the store (and watches the workers)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise RankEnvironmentError(
            f"environment variable {name}={value!r} is not an integer"
        ) from None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def address() -> tuple[str, int]:
    """The job's store, MASTER_ADDR:MASTER_PORT (torchrun's names): the one place reading them."""
    port = env_int("MASTER_PORT")
    if port is None:
        raise RankEnvironmentError("MASTER_PORT is not set; launch with torchrun or set it")
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), port


def host_file(addr: str, port: int) -> Path:
    """Where rank 0 says which process serves the store at addr:port (on rank 0's machine)."""
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in addr)
    return Path(f"/dev/shm/megart-store-{os.getuid()}-{safe}-{port}")


# Rank 0's host file while it stands: (path, its text).
_announced: tuple[Path, str] | None = None


def _announce(addr: str, port: int) -> None:
    """Rank 0: writes the host file (best effort: it only speeds up the others' diagnosis)."""
    global _announced
    path = host_file(addr, port)
    text = f"{os.getpid()} {time.time():.3f}\n"
    try:
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        return
    _announced = (path, text)
    atexit.register(withdraw)


def withdraw() -> None:
    """Rank 0: removes its host file once every rank has joined (init() calls this; later
    deaths are noticed through the exchanged pids), or at exit. Only a SIGKILL during start-up
    leaves it, and the rank that finds it naming a dead process removes it."""
    global _announced
    if _announced is None:
        return
    path, text = _announced
    _announced = None
    try:
        if path.read_text() == text:  # not a later job's on the same port
            path.unlink()
    except OSError:
        pass


def _started_at() -> float:
    """This process's start, in wall-clock seconds (now, where /proc cannot say)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _dead_host(addr: str, port: int, since: float) -> int | None:
    """The pid of this job's rank 0 when the host file says it served the store and it has
    exited; None when there is no such file (rank 0 not started yet, or on another machine),
    the file is an earlier job's, or its process runs."""
    try:
        pid_text, written = host_file(addr, port).read_text().split()
        pid = int(pid_text)
        if float(written) < since - _SAME_JOB_SLACK_S:
            return None
    except (OSError, ValueError):
        return None
    if process_alive(pid):
        return None
    return pid


def _forget_dead_host(addr: str, port: int, pid: int) -> None:
    """Removes the host file of a rank 0 that died (it could not): nothing of a job outlives it."""
    path = host_file(addr, port)
    try:
        if path.read_text().split()[0] == str(pid):
            path.unlink()
    except (OSError, IndexError):
        pass


def _moments() -> Iterator[int]:
    """Steps of 0.1 s for up to _DEAD_FOR_S: a killed process's sockets close before it is
    marked as exited, so a broken connection is followed by a short look for the exit."""
    for i in range(int(_DEAD_FOR_S / 0.1)):
        if i:
            time.sleep(0.1)
        yield i


def exited_soon(pid: int) -> bool:
    """Whether process ``pid`` is gone, or goes within _DEAD_FOR_S (see _moments)."""
    return any(not process_alive(pid) for _ in _moments())


def _listening(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def tcp_store(
    addr: str, port: int, world_size: int | None, master: bool, timeout: timedelta
) -> object:
    """torch's TCPStore: the server (``master``) or a client of addr:port."""
    import torch.distributed as td

    # wait_for_workers=False: exchange_pids waits, saying for whom.
    return td.TCPStore(
        addr, port, world_size, is_master=master, timeout=timeout, wait_for_workers=False
    )


def connect(rank: int, world_size: int, timeout: timedelta) -> object:
    """The job's TCPStore. Under torchrun its agent already serves one at MASTER_ADDR:MASTER_PORT
    (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects to it as a client, instead of rank 0
    trying (and failing, with an error line) to bind a second server to the same port. Without
    torchrun rank 0 serves it; the others wait for it, saying so, and fail within seconds if
    rank 0 started and died."""
    addr, port = address()
    agent = under_agent()
    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0 and not agent:
        _await_host(rank, addr, port, timeout)
    try:
        left = timedelta(seconds=max(deadline - time.monotonic(), 1.0))
        store = tcp_store(addr, port, None if agent else world_size, rank == 0 and not agent, left)
    except (RuntimeError, TimeoutError) as e:
        if rank == 0 and not agent and "EADDRINUSE" in str(e):
            raise PortInUseError(
                f"rank 0: MASTER_PORT {port} is already in use at {addr}, so it cannot serve "
                "the rendezvous: give a free port (torchrun --master-port), or end the process "
                "that holds it"
            ) from None
        raise CommTimeoutError(
            f"rank {rank}: could not reach the rendezvous at {addr}:{port} within "
            f"{timeout.total_seconds():.0f} s ({str(e).splitlines()[0]}): is rank 0 running "
            "with the same MASTER_ADDR and MASTER_PORT?"
        ) from None
    if rank == 0 and not agent:
        _announce(addr, port)
    # The timeout above bounded connecting; every later store op has the job's.
    store.set_timeout(timeout)
    return store


class Wait:
    """A wait bounded by ``timeout`` that says every few seconds what it waits for."""

    def __init__(self, timeout: timedelta) -> None:
        self.limit = timeout.total_seconds()
        self.start = time.monotonic()
        self.every = min(NOTICE_S, self.limit / 4)
        self.next_notice = self.start + self.every

    def step(self, waiting: str, gave_up: str, pause: float) -> None:
        """One round: raises CommTimeoutError(``gave_up``) past the limit; else prints
        "megart: WAITING (gives up after N s)" when one is due, and sleeps ``pause`` s."""
        now = time.monotonic()
        if now - self.start > self.limit:
            raise CommTimeoutError(gave_up)
        if now >= self.next_notice:
            self.next_notice = now + self.every
            print(
                f"megart: {waiting} (gives up after {self.limit:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(pause)


def _await_host(rank: int, addr: str, port: int, timeout: timedelta) -> None:
    """Returns once something listens at addr:port. A bare connect, not torch's client: its
    retries log a stack trace each and cannot be told to look at rank 0 in between."""
    since = _started_at()
    wait = Wait(timeout)
    dead_since: float | None = None
    while not _listening(addr, port):
        now = time.monotonic()
        dead = _dead_host(addr, port, since)
        dead_since = None if dead is None else (dead_since or now)
        if dead is not None and now - dead_since >= _DEAD_FOR_S:
            _forget_dead_host(addr, port, dead)
            raise CommError(
                f"rank {rank}: rank 0 (pid {dead}), which serves the rendezvous store at "
                f"{addr}:{port}, exited before rank {rank} could connect: see rank 0's output "
                "for why, and start the job again"
            )
        wait.step(
            f"rank {rank} is waiting for rank 0 to serve the rendezvous at {addr}:{port}",
            f"rank {rank}: nothing serves the rendezvous at {addr}:{port} after "
            f"{wait.limit:.0f} s: is rank 0 running with the same MASTER_ADDR and MASTER_PORT?",
            0.1,
        )


def exchange_pids(store: object, rank: int, world_size: int, timeout: timedelta) -> list[int]:
    """Every rank posts its process id and waits for everyone's; returns them by rank. Says whom
    it waits for every few seconds and gives up at the timeout, naming the missing ranks; fails
    at once, naming rank 0, when the store (rank 0's, without torchrun) goes away."""
    try:
        return _exchange(store, rank, world_size, timeout)
    except RuntimeError as e:  # torch's DistError and its kinds: the connection broke
        if under_agent() or isinstance(e, CommTimeoutError):
            raise
        addr, port = address()
        gone = None
        for _ in _moments():
            gone = _dead_host(addr, port, 0.0)
            if gone is not None:
                break
        who = "rank 0"
        if gone is not None:
            who = f"rank 0 (pid {gone})"
            _forget_dead_host(addr, port, gone)
        raise CommError(
            f"rank {rank}: the rendezvous store at {addr}:{port} went away "
            f"({str(e).splitlines()[0]}): {who}, which serves it, has exited or dropped the "
            "connection; see rank 0's output for why"
        ) from None


def _exchange(store: object, rank: int, world_size: int, timeout: timedelta) -> list[int]:
    prefix = key_prefix() + "pid/"
    store.set(f"{prefix}{rank}", str(os.getpid()))
    keys = [f"{prefix}{r}" for r in range(world_size)]
    wait = Wait(timeout)
    where = "{}:{}".format(*address())
    missing = list(range(world_size))
    while True:
        # A rank's key, once set, stays: each round asks the store only about those still
        # missing (one request per rank per round, from every rank, would grow as world size
        # squared on rank 0's store).
        missing = [r for r in missing if not store.check([keys[r]])]
        if not missing:
            break
        wait.step(
            f"rank {rank} is waiting at {where} for rank(s) {missing} of WORLD_SIZE={world_size}",
            f"rank {rank}: rank(s) {missing} of WORLD_SIZE={world_size} did not join the "
            f"rendezvous at {where} within {wait.limit:.0f} s: start every rank "
            "(torchrun --nproc-per-node N starts N), or set WORLD_SIZE to the ranks you start",
            0.02,
        )
    return [int(store.get(k)) for k in keys]
