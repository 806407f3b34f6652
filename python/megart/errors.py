"""megart's typed errors. Each says what went wrong and what to change.

- ``MegartError``: base of all (a ``RuntimeError``).
- ``ConfigError``: a bad argument or layout (also a ``ValueError``).
- ``ScheduleError``: a schedule that breaks a rule; ``DeadlockError``: one that cannot progress.
"""

from megart._core import ConfigError, DeadlockError, MegartError, ScheduleError

__all__ = ["MegartError", "ConfigError", "ScheduleError", "DeadlockError"]
