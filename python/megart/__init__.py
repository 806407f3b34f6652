"""megart: Megatron-style parallel training of GPT models with a C++/CUDA core.

Importing megart never needs a GPU, a CUDA driver, NCCL or torch; those are looked for only when
used. ``megart.build_info()`` says what this install was built with and what it finds.
``megart.initialize(tp=..., pp=...)`` lays out the ranks and makes their process groups.
"""

from megart._build_info import build_info
from megart._core import __version__
from megart.errors import (
    CommError,
    CommTimeoutError,
    ConfigError,
    DeadlockError,
    MegartError,
    RankEnvironmentError,
    ScheduleError,
    TrainingError,
)
from megart.parallel import initialize


def __getattr__(name: str) -> object:
    # The trainer pulls in torch; load it on first use so `import megart` stays light.
    if name in ("Trainer", "TrainConfig"):
        from megart.training import config, trainer

        return {"Trainer": trainer.Trainer, "TrainConfig": config.TrainConfig}[name]
    raise AttributeError(f"module 'megart' has no attribute {name!r}")


__all__ = [
    "__version__",
    "Trainer",
    "TrainConfig",
    "build_info",
    "initialize",
    "MegartError",
    "ConfigError",
    "RankEnvironmentError",
    "ScheduleError",
    "DeadlockError",
    "CommError",
    "TrainingError",
    "CommTimeoutError",
]
