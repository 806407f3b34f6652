"""Random streams for dropout under tensor parallelism.

Two kinds of activations need two kinds of randomness:

- replicated activations (outside tensor-parallel regions: after a RowParallelLinear's
  all-reduce, the residual stream) must be dropped identically on every rank of the group, or
  the replicas drift apart. They use torch's default generator, seeded the same on every
  tensor-parallel rank.
- split activations (inside a region: attention probabilities of this rank's heads, the
  output of a ColumnParallelLinear) must get independent masks per rank, or the t slices of
  one layer share a mask pattern. They use a named stream with a seed offset by the rank.

An :class:`RNGStatesTracker` holds the named streams; ``fork(tracker, name)`` runs a block with
torch's generator(s) switched to that stream and switches back, leaving the default stream
exactly where it was. Nothing here is global: the tracker is an object the model owns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megart.errors import ConfigError

TENSOR_PARALLEL = "tensor-parallel"

# Keeps the tensor-parallel streams' seeds away from the default stream's (any constant does;
# it only has to differ from 0 by more than the tensor-parallel size).
TP_SEED_OFFSET = 2718


def _cuda() -> bool:
    return torch.cuda.is_available()


class GeneratorStates:
    """Generator states of one stream: the CPU one and, when there is a GPU, the current
    device's. Also what a checkpoint saves of torch's default generators."""

    def __init__(self, cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
        self.cpu, self.cuda = cpu, cuda

    @classmethod
    def current(cls) -> GeneratorStates:
        """torch's default generators as they are now (copies)."""
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda() else None)

    @classmethod
    def seeded(cls, seed: int) -> GeneratorStates:
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if _cuda():
            # The default CUDA generator's state format is its own: seed it, read, restore.
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)
        return cls(cpu, cuda)

    def install(self) -> None:
        """Makes these torch's default generators' states. A CUDA state is skipped where there
        is no GPU: a checkpoint written on GPUs can resume on a CPU."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and _cuda():
            torch.cuda.set_rng_state(self.cuda)


class RNGStatesTracker:
    """Named random streams that can be swapped in for torch's default generators."""

    def __init__(self) -> None:
        self._states: dict[str, GeneratorStates] = {}

    def add(self, name: str, seed: int) -> None:
        """Creates stream ``name`` starting from ``seed``."""
        if name in self._states:
            raise ConfigError(f"random stream '{name}' already exists in this tracker")
        self._states[name] = GeneratorStates.seeded(seed)

    def names(self) -> list[str]:
        return list(self._states)

    def get_states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Every stream's (CPU, CUDA) generator state, for a checkpoint."""
        return {
            n: (s.cpu.clone(), None if s.cuda is None else s.cuda.clone())
            for n, s in self._states.items()
        }

    def set_states(self, states: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Restores streams saved by :meth:`get_states` (replacing all current ones)."""
        self._states = {
            n: GeneratorStates(cpu.clone(), None if cuda is None else cuda.clone())
            for n, (cpu, cuda) in states.items()
        }

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL) -> Iterator[None]:
        """Runs the block on stream ``name``; afterwards the stream keeps its advanced state and
        torch's default generators are back where they were."""
        if name not in self._states:
            raise ConfigError(
                f"random stream '{name}' does not exist; add it first (tracker.add or "
                "seed_tensor_parallel)"
            )
        outside = GeneratorStates.current()
        self._states[name].install()
        try:
            yield
        finally:
            self._states[name] = GeneratorStates.current()
            outside.install()


def fork(
    tracker: RNGStatesTracker, name: str = TENSOR_PARALLEL
) -> contextlib.AbstractContextManager:
    """``with fork(tracker):`` runs a block on the tracker's tensor-parallel stream."""
    return tracker.fork(name)


def seed_tensor_parallel(tracker: RNGStatesTracker, seed: int, tp_rank: int) -> None:
    """Seeds torch's default generators with ``seed`` (call it with the same seed on every
    tensor-parallel rank: that stream is for replicated work) and adds the tensor-parallel
    stream, seeded ``seed + TP_SEED_OFFSET + tp_rank`` (distinct per rank). Callers that want
    distinct replicated streams across pipeline stages fold the stage into ``seed``."""
    torch.manual_seed(seed)
    tracker.add(TENSOR_PARALLEL, seed + TP_SEED_OFFSET + tp_rank)
