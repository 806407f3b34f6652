"""How ``megart train`` ends on an error: one readable message, the same exit status everywhere.

A configuration error is found by every rank alike, before any rank waits on another; printed by
each, 8 ranks would say it 8 times. Without torchrun, rank 0 says it and every rank exits with 2.

Under torchrun two more things get in the way: the agent stops the other workers (SIGTERM) as
soon as one exits, so their statuses differ (2 and -15) and the rank meant to print may be
stopped before it does; and the agent then prints its ChildFailedError block, about 40 lines,
after everything the workers wrote. The agent shows a worker's own message in that block when
the worker leaves it in TORCHELASTIC_ERROR_FILE (torch.distributed.elastic's error-file
protocol; the ``@record`` decorator writes the same file with a traceback). So under torchrun the
ranks that hit a configuration error meet in the agent's store, ignore the agent's SIGTERM once
they have decided to exit, and all exit with 2, the lowest of them first; it writes the message
to its error file, and the block ends with it (its "Root Cause"), once. Other errors differ per
rank (which peer each saw fail; a rank's own RANK or device): each rank prints its own and
leaves it in its error file too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta

from megart.errors import ConfigError, RankEnvironmentError

EXIT_STATUS = 2
# How long ranks that hit a configuration error wait for the others to hit it too (they started
# together and check the same flags, but 8 ranks importing torch on 2 cores take a while).
_MEET_S = 30.0
# A rank that joined the rendezvous instead has passed the checks: it is waited for this long.
_JOINED_GRACE_S = 2.0
# The other ranks exit after the one that reports (see _outlive): at most this long after the
# meeting, and then later than the agent's next look (torchrun's --monitor-interval, 0.1 s).
_OUTLIVE_S = 5.0
_AGENT_LOOKS_S = 0.5


def exit_on_error(prog: str, error: Exception) -> int:
    """Says ``error`` as described above and returns the status every rank exits with."""
    message = f"{prog}: error: {error}"
    from megart.distributed.rendezvous import under_agent

    try:
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        rank = -1  # a RANK that is no number: this rank's own error, said below
    # An error of this rank's own environment, or one found after the ranks parted ways, is
    # this rank's to say; a flag error every rank finds alike is rank 0's.
    own = not isinstance(error, ConfigError) or isinstance(error, RankEnvironmentError)
    if not under_agent():
        if own or rank == 0:
            print(message, file=sys.stderr, flush=True)
        return EXIT_STATUS
    # From here on this rank exits with EXIT_STATUS by itself: the agent's stop must not turn
    # that into -15 (it would also cut short the meeting below).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if own:
        print(message, file=sys.stderr, flush=True)
        _write_error_file(message)
        return EXIT_STATUS
    first, where = _lowest_rank_with_the_error(rank)
    if first == rank:
        if not _write_error_file(message):
            print(message, file=sys.stderr, flush=True)  # no agent to show it: say it here
        return EXIT_STATUS
    _outlive(where)  # then this file's timestamp is not earlier than the reporter's either
    _write_error_file(f"{prog}: stopped by the configuration error that rank {first} reports")
    return EXIT_STATUS


def _outlive(where: str) -> None:
    """Returns once the rank that reports the error (``where``: "host pid") has exited, if it
    runs on this machine, and the agent has had time to see it alone. The agent names as root
    cause the failure with the earliest timestamp (whole seconds), the first one it saw among
    equals: exiting after it keeps that rank's message at the end of the report."""
    from megart.distributed.rendezvous import process_alive

    host, _, pid = where.partition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return
    deadline = time.monotonic() + _OUTLIVE_S
    while process_alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(_AGENT_LOOKS_S)


def _write_error_file(message: str) -> bool:
    """Leaves ``message`` where torchrun's agent reads it; False when there is no such place."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


def _lowest_rank_with_the_error(rank: int) -> tuple[int, str]:
    """Posts in torchrun's store that this rank hit a configuration error and waits (bounded)
    until every rank has posted or joined the rendezvous (it passed the checks); returns the
    lowest rank that posted and where it runs ("host pid"). This rank when the store cannot be
    reached."""
    from megart.distributed import rendezvous

    here = f"{socket.gethostname()} {os.getpid()}"
    world = rendezvous.env_int("WORLD_SIZE") or 1
    try:
        addr, port = rendezvous.address()
    except RankEnvironmentError:  # no store to meet in: this rank reports alone
        return rank, here
    prefix = rendezvous.key_prefix()
    try:
        store = rendezvous.tcp_store(addr, port, None, False, timedelta(seconds=10))
        store.set(f"{prefix}config-error/{rank}", here)
        deadline = time.monotonic() + _MEET_S
        joined_at: float | None = None
        while True:
            posted = [r for r in range(world) if store.check([f"{prefix}config-error/{r}"])]
            missing = [r for r in range(world) if r not in posted]
            now = time.monotonic()
            joined = all(store.check([f"{prefix}pid/{r}"]) for r in missing)
            joined_at = (joined_at or now) if joined else None
            if not missing or now > deadline or (joined and now - joined_at > _JOINED_GRACE_S):
                first = min(posted)
                return first, store.get(f"{prefix}config-error/{first}").decode()
            time.sleep(0.05)
    except RuntimeError:  # the store went away (torch's DistError): say it here
        return rank, here
