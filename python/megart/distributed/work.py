"""An op in flight (:class:`Work`) and the tensors its group keeps until the op completes.

On the nccl transport an op runs on the device after its call returns, so its tensors must
outlive it: the Work holds them until ``wait()`` or ``is_completed()`` says the op is done, and
after ``wait_stream()`` (or when a Work is dropped unfinished) the group's in-flight list does,
letting them go once the op has completed."""

from __future__ import annotations

import threading
import time
from abc import ABCMeta
from collections.abc import Sequence

import torch

from megart._core import comm as _comm
from megart.distributed.group import ProcessGroup, context
from megart.errors import CommTimeoutError


class Work(metaclass=ABCMeta):  # noqa: B024 - an ABC only so the C++ twin registers
    """An op in flight. Keeps its tensors alive until it has completed. (batch_isend_irecv on
    the shm transport returns its C++ twin, registered as a Work below: same methods.)"""

    __slots__ = ("_work", "_tensors", "_group")

    def __init__(
        self, work: object, tensors: Sequence[torch.Tensor], group: ProcessGroup | None = None
    ) -> None:
        self._work = work
        self._tensors = list(tensors)
        self._group = group

    def wait(self) -> bool:
        """torch.distributed's semantics: on a device transport (nccl) the current stream
        waits for the op and the host goes on, so a training loop never stalls between
        kernels; on a host transport (shm) it blocks until the op has finished. Raises
        CommError if the op failed (on nccl, failures that come later reach the watchdog)."""
        g = self._group
        if g is not None and g.backend == "nccl":
            self.wait_stream()
            return True
        return self.synchronize()

    def synchronize(self) -> bool:
        """Blocks the host until the op has finished, on every transport; raises CommError
        (CommTimeoutError past the group's timeout) if it failed."""
        self._work.wait()
        self._tensors = []
        return True

    def wait_stream(self, stream: object = None) -> None:
        """Orders ``stream`` (a torch.cuda.Stream or a raw handle; default: the current stream
        of the group's device) after the op without blocking the host (nccl). On the shm
        transport the op is on host memory, so this waits on the host."""
        g = self._group
        if g is None or g.backend != "nccl":
            self.synchronize()
            return
        if stream is None:
            stream = current_stream(g.device)
        self._work.wait_stream(int(getattr(stream, "cuda_stream", stream)))
        if self._tensors:  # the op may still be running: the group keeps its tensors
            _keep_until_done(g, self._work, self._tensors)
            self._tensors = []

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._tensors = []
        return done

    def __del__(self) -> None:
        # Dropped before its op was seen to finish (an isend never waited on): an nccl op may
        # still read or write its tensors on the device, and the caching allocator would hand
        # their memory out at once, so the group keeps them until the op completes.
        try:
            g = self._group
            if self._tensors and g is not None and g.backend == "nccl":
                _keep(g, self._work, self._tensors, time.monotonic())
        except Exception:  # a finaliser must not raise (at interpreter exit, say)
            pass


Work.register(_comm.HostWork)


# Guards every group's in_flight list: ops are posted from the training thread, and Works are
# dropped (__del__) from whatever thread the garbage collector runs in.
_in_flight_lock = threading.Lock()


def current_stream(device: int | None) -> object:
    """The caller's current CUDA stream on ``device`` (a test double may stand in for it)."""
    return torch.cuda.current_stream(device)


def _keep_until_done(g: ProcessGroup, work: object, tensors: list[torch.Tensor]) -> None:
    """Keeps ``tensors`` until ``work`` completes; an op older than the timeout that has not
    completed aborts the group (the watchdog normally ends the process first)."""
    now = time.monotonic()
    oldest = _keep(g, work, tensors, now)
    if oldest is not None and now - oldest > context().timeout.total_seconds():
        g.comm.abort()
        raise CommTimeoutError(
            f"rank {context().rank}: an op of group '{g.name}' has not completed after "
            f"{context().timeout}; the group was aborted"
        )


def _keep(g: ProcessGroup, work: object, tensors: list[torch.Tensor], now: float) -> float | None:
    """Appends (work, tensors) to the group's in-flight list after letting completed ops go
    from its front (ops complete in about the order posted, so this polls one or two per op,
    not every op in flight). Returns the posting time of the oldest op still in flight."""
    with _in_flight_lock:
        flight = g.in_flight
        done = 0
        while done < len(flight) and flight[done][0].is_completed():
            done += 1
        del flight[:done]
        flight.append((work, tensors, now))
        return flight[0][2]
