"""megart's typed errors. Each says what went wrong and what to change.

- ``MegartError``: base of all (a ``RuntimeError``).
- ``ConfigError``: a bad argument or layout (also a ``ValueError``).
- ``RankEnvironmentError``: a ``ConfigError`` in one rank's own environment (its RANK,
  LOCAL_RANK, MASTER_PORT, device), which the other ranks may not share; ``PortInUseError``:
  one whose MASTER_PORT another process already holds.
- ``ScheduleError``: a schedule that breaks a rule; ``DeadlockError``: one that cannot progress.
- ``CommError``: a communication op failed (a dead peer, an abort, ranks that disagree);
  ``CommTimeoutError``: a wait ran past its timeout (also a ``TimeoutError``). Both name this
  rank, the op, the peer and the group.
- ``TrainingError``: training cannot go on (a loss or gradient norm that is not finite).
- ``CheckpointError``: a (background, --async-save) save that did not complete.
"""

from megart._core import (
    CommError,
    CommTimeoutError,
    ConfigError,
    DeadlockError,
    MegartError,
    ScheduleError,
)


class RankEnvironmentError(ConfigError):
    """A configuration error in one rank's own environment (RANK, LOCAL_RANK, MASTER_PORT, its
    device): unlike a flag, which every rank checks alike, the other ranks may not find it, so
    the rank that does says it itself."""


class PortInUseError(RankEnvironmentError):
    """Rank 0 cannot serve the rendezvous: another process holds MASTER_PORT. megart's launcher
    picks a new port and starts again; under torchrun, give another --master-port."""


class TrainingError(MegartError):
    """Training cannot go on: a loss or gradient norm that is not finite. Says the iteration,
    the value and what to change."""


__all__ = [
    "MegartError",
    "ConfigError",
    "RankEnvironmentError",
    "PortInUseError",
    "ScheduleError",
    "DeadlockError",
    "CommError",
    "CommTimeoutError",
    "TrainingError",
]


class CheckpointError(MegartError):
    """A save that did not complete (a rank's background write failed): says which rank and
    iteration; the tracker file still names the last complete checkpoint."""
