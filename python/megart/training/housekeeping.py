"""What Megatron-LM does around each iteration besides training, at the same points of the loop
(its training.py): --manual-gc (Python's collector off, collections at chosen points, the same
on every rank), --empty-unused-memory-level (CUDA's cached blocks returned) and --profile
(torch's profiler, or a CUDA profiler range that nsys captures)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class Housekeeping:
    """The chores of one rank's run; every method is a no-op for flags left out."""

    def __init__(self, config: Any, device: torch.device, rank: int) -> None:
        self.config = c = config
        self.cuda = device.type == "cuda"
        self.profiling = c.profile and (not c.profile_ranks or rank in c.profile_ranks)
        self.rank = rank
        self.profiler: torch.profiler.profile | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the training loop: the collector off (megart turns it back on after, so
        that a Python program calling the Trainer keeps its own), the profiler started."""
        c = self.config
        was_enabled = gc.isenabled()
        if c.manual_gc:
            gc.disable()
            gc.collect()
        if self.profiling and c.use_pytorch_profiler:
            self.profiler = self._torch_profiler()
            self.profiler.start()
        try:
            yield
        finally:
            if self.profiler is not None:  # a run that ended before --profile-step-end
                self.profiler.stop()
            self.profiler = None
            if c.manual_gc and was_enabled:
                gc.enable()

    def before_iteration(self, done: int) -> None:
        """At the top of the loop, ``done`` iterations trained so far."""
        if not self.profiling:
            return
        if self.profiler is not None:
            self.profiler.step()
        elif done == self.config.profile_step_start and not self.config.use_pytorch_profiler:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())

    def after_forward_backward(self) -> None:
        """After an iteration's forward and backward, and after each evaluation batch."""
        if self.config.empty_unused_memory_level >= 1:
            self._empty_cache()

    def after_optimizer_step(self) -> None:
        if self.config.empty_unused_memory_level >= 2:
            self._empty_cache()

    def after_iteration(self, done: int) -> None:
        """After the iteration that made ``done`` iterations trained."""
        c = self.config
        if self.profiling and done == c.profile_step_end:
            if self.profiler is not None:
                self.profiler.stop()
                self.profiler = None
            elif not c.use_pytorch_profiler:
                torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        if c.manual_gc and c.manual_gc_interval and done % c.manual_gc_interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Around an evaluation in the loop: everything collected before, and after it what
        the evaluation made (the youngest generation), as Megatron-LM does."""
        collect = self.config.manual_gc and self.config.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)

    def _empty_cache(self) -> None:
        if self.cuda:  # the CPU has no caching allocator to return blocks from
            torch.cuda.empty_cache()

    def _torch_profiler(self) -> torch.profiler.profile:
        """Megatron-LM's schedule (wait until the step before --profile-step-start, one step of
        warm-up, active until --profile-step-end) and its trace's place."""
        c = self.config
        where = Path(c.tensorboard_dir).absolute().parent / "torch_profile"
        rank = self.rank

        def write(prof: torch.profiler.profile) -> None:
            where.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(where / f"rank-{rank}.json.gz"))

        start = c.profile_step_start
        return torch.profiler.profile(
            schedule=torch.profiler.schedule(
                wait=max(start - 1, 0),
                warmup=1 if start > 0 else 0,
                active=c.profile_step_end - start,
                repeat=1,
            ),
            on_trace_ready=write,
            record_shapes=c.pytorch_profiler_collect_shapes,
            with_stack=c.pytorch_profiler_collect_callstack,
        )
