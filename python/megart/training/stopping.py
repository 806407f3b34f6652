"""Stopping a run early and refusing to go on with a diverged one, as Megatron-LM's flags say.

- ``--exit-interval N``: stop after every N-th iteration (useful to split a job into pieces);
- ``--exit-duration-in-mins M``: stop once the run has trained M minutes (a job's time limit);
- ``--exit-signal-handler``: on SIGTERM (what schedulers send before they kill a job), finish
  the iteration and stop.

Stopping saves a checkpoint first when ``--save`` is given, so the run resumes with ``--load``.
Clocks and signals differ between ranks, so the ranks agree on stopping through one
all-reduce per iteration; an interval needs none.

``--check-for-nan-in-loss-and-grad`` (on by default, as Megatron's;
``--no-check-for-nan-in-loss-and-grad`` turns it off): a gradient norm that is not finite raises
TrainingError on every rank before the step, so the weights stay as they were; a loss that is
not finite raises after it.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

import megart.distributed as dist
from megart.errors import ConfigError, TrainingError


class EarlyExit:
    """Tells, after each iteration, whether the run should stop (the same answer on every
    rank). Use as a context manager: the SIGTERM handler is installed inside it only."""

    def __init__(self, config: Any, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.start = time.monotonic()
        self.signalled = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[EarlyExit]:
        if not self.config.exit_signal_handler:
            yield self
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "--exit-signal-handler installs a SIGTERM handler, which Python allows only in "
                "the main thread; train from the main thread or leave the flag out"
            )
        previous = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = True

    def reason(self, done: int) -> str | None:
        """Why the run stops after ``done`` iterations, or None to go on."""
        c = self.config
        if c.exit_interval and done % c.exit_interval == 0:
            return f"--exit-interval {c.exit_interval}"
        if not c.exit_signal_handler and c.exit_duration_in_mins is None:
            return None
        minutes = (time.monotonic() - self.start) / 60
        over = c.exit_duration_in_mins is not None and minutes > c.exit_duration_in_mins
        flags = torch.tensor([float(self.signalled), float(over)], device=self.device)
        dist.all_reduce(flags, op="max")
        if flags[0].item():
            return "SIGTERM (--exit-signal-handler)"
        if flags[1].item():
            return f"--exit-duration-in-mins {c.exit_duration_in_mins} ({minutes:.1f} trained)"
        return None


def check_finite(what: str, value: float, iteration: int) -> None:
    """TrainingError when ``value`` (the same on every rank) is not finite."""
    if math.isfinite(value):
        return
    raise TrainingError(
        f"iteration {iteration}: the {what} is {value}; training has diverged or the data holds "
        "a bad sample. Lower --lr, lengthen --lr-warmup-iters, clip with --clip-grad, or train "
        "with --bf16 (or --fp16, whose loss scale skips overflowing steps), then resume from "
        "the last checkpoint with --load; --no-check-for-nan-in-loss-and-grad goes on anyway"
    )
