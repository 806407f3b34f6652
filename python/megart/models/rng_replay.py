"""The random stream saved by a forward and replayed by its backward (the ring's explicit blocks'
attention dropout, megart.models.ring_attention): the backward draws the forward's masks again,
so that it is the forward's own derivative."""

from __future__ import annotations

import torch


def rng_state(device: torch.device) -> torch.Tensor:
    """The current random stream's state on ``device``'s kind (CUDA's or the CPU's)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


class replayed:  # noqa: N801 - a context manager, named as used
    """The random stream set back to ``state`` (saved by the forward) for the duration, so
    that the backward draws the forward's dropout masks again; the stream is restored after.
    Nothing without a state (no dropout)."""

    def __init__(self, state: torch.Tensor | None, device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self) -> None:
        if self.state is None:
            return
        self.now = rng_state(self.device)
        self._set(self.state)

    def __exit__(self, *exc: object) -> None:
        if self.state is not None:
            self._set(self.now)

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)
