"""The Trainer's saves: persistent ones to --save, non-persistent ones
(--non-persistent-save-interval) to their own directory (megart.training.save_modes), each
written at once or, with --async-save, in the background (megart.training.async_save) and
finalized before the next save and when training ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from megart.training import async_save, checkpoint, checkpoint_dirs


class Checkpointer:
    """Writes the Trainer's checkpoints and holds the background save in flight, if any."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.pending: async_save.AsyncSave | None = None

    def due(self, done: int, persistent_due: bool) -> str | None:
        """Which save iteration ``done`` makes: "persistent" when one is due (``persistent_due``),
        else "non-persistent" on a multiple of --non-persistent-save-interval (Megatron-LM's
        order), else None."""
        c = self.config
        if not c.save:
            return None
        if persistent_due:
            return "persistent"
        every = c.non_persistent_save_interval
        return "non-persistent" if every and done % every == 0 else None

    def save(self, kind: str, done: int, trainer: Any) -> None:
        """Every rank: ``trainer``'s state after ``done`` iterations, as ``kind`` (due's)."""
        self.finish()  # Megatron-LM finalizes the previous background save first
        c = self.config
        persistent = kind == "persistent"
        directory = c.save if persistent else checkpoint_dirs.non_persistent_dir(c)
        parts = (c, trainer.grid, trainer.chunks, trainer.optimizer, trainer.rng, trainer.scaler)
        if c.async_save:
            self.pending = async_save.start(
                directory, done, *parts, trainer.consumed, persistent=persistent
            )
        else:
            checkpoint.save(directory, done, *parts, trainer.consumed, persistent=persistent)

    def finish(self) -> None:
        """Every rank: the background save in flight, if any, finalized (its tracker written)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.finalize()

    def abandon(self) -> None:
        """After an exception in training (no waits on other ranks): the background save in
        flight completed if its files are (see AsyncSave.finalize_alone), else left unnamed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.finalize_alone()

    @contextlib.contextmanager
    def completing(self) -> Iterator[None]:
        """Around the training loop: a background save still in flight when it ends is
        finalized (finish); when it ends by an exception, without waiting on other ranks
        (abandon), and the exception goes on."""
        try:
            yield
        except BaseException:
            self.abandon()
            raise
        self.finish()
