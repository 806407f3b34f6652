"""megart's typed errors. Each says what went wrong and what to change.

- ``MegartError``: base of all (a ``RuntimeError``).
- ``ConfigError``: a bad argument or layout (also a ``ValueError``).
- ``ScheduleError``: a schedule that breaks a rule; ``DeadlockError``: one that cannot progress.
- ``CommError``: a communication op failed (a dead peer, an abort, ranks that disagree);
  ``CommTimeoutError``: a wait ran past its timeout (also a ``TimeoutError``). Both name this
  rank, the op, the peer and the group.
- ``TrainingError``: training cannot go on (a loss or gradient norm that is not finite).
"""

from megart._core import (
    CommError,
    CommTimeoutError,
    ConfigError,
    DeadlockError,
    MegartError,
    ScheduleError,
)


class TrainingError(MegartError):
    """Training cannot go on: a loss or gradient norm that is not finite. Says the iteration,
    the value and what to change."""


__all__ = [
    "MegartError",
    "ConfigError",
    "ScheduleError",
    "DeadlockError",
    "CommError",
    "CommTimeoutError",
    "TrainingError",
]
