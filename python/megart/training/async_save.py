"""--async-save: Megatron-LM's background saves of torch_dist checkpoints.

``start`` takes the snapshot while training waits: every rank's slices of the store as copies
of its tensors in host memory (dist_store.Slices copies each piece; the objects beside them are
deep-copied),
and rank 0's common.pt, so the steps that follow may change the weights, the moments and the
random streams without reaching the files. A thread then writes the rank's part into the
save's ``iter_N.partial`` folder while training goes on. Nothing names the checkpoint yet: as
in Megatron-LM, the tracker file (latest_checkpointed_iteration.txt) is written only when the
save is finalized, once every rank's files are complete.

``AsyncSave.finalize`` (every rank, before the next save and at the end of training, as
Megatron-LM's maybe_finalize_async_save) joins the thread, waits for the other ranks, and has
rank 0 merge the store's metadata, write common.pt and rename the folder into place, then the
tracker. After an exception in training ``finalize_alone`` does the same without waiting on
other ranks (one that failed may never come): each rank joins its own thread, and rank 0
publishes the checkpoint only if every writing rank's files are complete (each marks its part
done or failed in the folder), for at most --distributed-timeout-minutes; otherwise the folder
stays ``.partial`` and the tracker keeps naming the last complete checkpoint.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from pathlib import Path
from typing import Any

import megart.distributed as dist
from megart.errors import CheckpointError
from megart.training import dist_store, megatron_dist_train
from megart.training.checkpoint_save import begin, dist_writer, publish, swap_in
from megart.training.ckpt_files import iteration_dir

_WRITING, _DONE, _FAILED = "__writing_", "__done_", "__failed_"


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as the snapshot holds it: each Slices' pieces (copies already) in host memory,
    copied there now, so that the copy is complete before training goes on whatever stream
    the device's work runs on (and holds no device memory while it is written, as
    Megatron-LM's background saves copy to the host first); every other value deep-copied."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dist_store.Slices):
            value.pieces = {at: piece.cpu() for at, piece in value.pieces.items()}
            out[key] = value
        else:
            out[key] = copy.deepcopy(value)
    return out


def _marks(partial: Path, prefix: str) -> set[int]:
    return {int(p.name[len(prefix) :]) for p in partial.glob(prefix + "*")}


class AsyncSave:
    """One torch_dist save in flight: its thread, and what finalizing it needs."""

    def __init__(
        self,
        directory: str | os.PathLike,
        iteration: int,
        partial: Path,
        retain: int | None,
        state: dict[str, Any] | None,
        common: dict[str, Any] | None,
        timeout_s: float,
    ) -> None:
        self.directory, self.iteration, self.partial = directory, iteration, partial
        self.retain, self.common, self.timeout_s = retain, common, timeout_s
        self.rank = dist.get_rank()
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._write, args=(state,), name=f"megart-save-{iteration}"
        )

    def _write(self, state: dict[str, Any] | None) -> None:
        mark = _DONE
        try:
            if state is not None:
                dist_store.write_rank(self.partial, self.rank, state)
        except BaseException as e:  # told at finalize, on this rank; the others see the mark
            self.error, mark = e, _FAILED
        finally:
            if state is not None:
                (self.partial / f"{mark}{self.rank}").touch()

    def finalize(self) -> Path:
        """Every rank: waits for the files, then publishes the checkpoint (rank 0) and its
        tracker; raises CheckpointError (on every rank) if a rank's write failed, leaving the
        tracker as it was."""
        self._thread.join()
        dist.barrier()
        failed = sorted(_marks(self.partial, _FAILED))
        if failed:
            raise CheckpointError(
                f"the background save of iteration {self.iteration} to {self.directory} failed "
                f"on rank(s) {failed}"
                + (f": {self.error}" if self.error else "")
                + "; the tracker still names the last complete checkpoint"
            ) from self.error
        if self.rank == 0:
            self._complete()
        return publish(self.directory, self.iteration, self.partial, self._final, self.retain)

    def finalize_alone(self) -> bool:
        """After an exception in training, on each rank with no wait on another: joins this
        rank's thread; rank 0 publishes the checkpoint if every writer's part is complete
        (waiting for them at most the timeout). Returns whether it was published here."""
        self._thread.join()
        if self.rank != 0:
            return False
        writers = _marks(self.partial, _WRITING)
        deadline = time.monotonic() + self.timeout_s
        while True:
            done, failed = _marks(self.partial, _DONE), _marks(self.partial, _FAILED)
            if failed or writers <= done or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if failed or not writers <= done:
            return False
        self._complete()
        swap_in(self.directory, self.iteration, self.partial, self._final, self.retain)
        return True

    @property
    def _final(self) -> Path:
        return iteration_dir(self.directory, self.iteration)

    def _complete(self) -> None:
        """Rank 0, once every part is written: the markers removed, the store's metadata
        merged, common.pt and metadata.json written."""
        for prefix in (_WRITING, _DONE):
            for p in self.partial.glob(prefix + "*"):
                p.unlink()
        assert self.common is not None
        megatron_dist_train.write_common(self.partial, self.common)


def start(
    directory: str | os.PathLike,
    iteration: int,
    config: Any,
    grid: Any,
    chunks: list[Any],
    optimizer: Any,
    rng: Any,
    scaler: Any = None,
    consumed_samples: int | None = None,
    persistent: bool = True,
) -> AsyncSave:
    """Every rank: the snapshot of this job's state after ``iteration`` iterations, and its
    thread started (arguments as checkpoint_save.save's)."""
    partial = begin(directory, iteration, persistent)
    consumed = (
        iteration * config.global_batch_size if consumed_samples is None else consumed_samples
    )
    rank = dist.get_rank()
    state = None
    if dist_writer(config, grid):
        state = _copied(
            megatron_dist_train.rank_state(config, grid, chunks, optimizer, rng, scaler)
        )
        (partial / f"{_WRITING}{rank}").touch()
    common = None
    if rank == 0:
        args = (config, chunks, grid.layout.dp, optimizer, scaler, iteration, consumed)
        common = copy.deepcopy(megatron_dist_train.common_state(*args))
    dist.barrier()  # every writer's mark is there before any part can be done
    retain = config.save_retain_interval if persistent else None
    timeout = 60.0 * config.distributed_timeout_minutes
    pending = AsyncSave(directory, iteration, partial, retain, state, common, timeout)
    pending._thread.start()
    return pending
