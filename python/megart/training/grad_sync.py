"""Data-parallel gradient averaging in buckets that start while backward is still running.

Gradients live in a few flat buffers (``param.grad`` is a view into one), filled in reverse
parameter order, the order backward produces them. A bucket is all-reduced as soon as every
one of its parameters has received its last gradient of the iteration (``expected`` backward
passes each, one per microbatch), while backward goes on with earlier layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        dtype, device = params[0].dtype, params[0].device
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.pending = len(params)
        self.work: dist.Work | None = None
        offset = 0
        for p in params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


class GradientBuckets:
    """Averages the gradients of ``params`` over ``dp_group`` (None or size 1: nothing to do).

    Call :meth:`start_iteration` with the number of backward passes each parameter will see
    (the microbatches), run the backward passes, then :meth:`finish` to wait for the last
    reductions. Gradients accumulate across microbatches into the same buffers. With
    ``overlap`` False every bucket is reduced in :meth:`finish` instead (the baseline that
    bench/dp_overlap.py compares with).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        dp_group: ProcessGroup | None,
        bucket_bytes: int = 4 << 20,
        overlap: bool = True,
    ) -> None:
        self.group = dp_group
        self.overlap = overlap
        params = [p for p in params if p.requires_grad]
        self.buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            if current and (
                size + p.numel() * p.element_size() > bucket_bytes or p.dtype != current[0].dtype
            ):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self.buckets.append(_Bucket(current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._seen: dict[int, int] = {}
        self._expected = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @property
    def active(self) -> bool:
        return self.group is not None and self.group.size() > 1

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()

    def start_iteration(self, backward_passes: int) -> None:
        self._expected = backward_passes
        self._seen = {}
        for b in self.buckets:
            b.pending, b.work = len(b.params), None

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        n = self._seen.get(id(p), 0) + 1
        self._seen[id(p)] = n
        if n != self._expected:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0 and self.active and self.overlap:
            b.work = dist.all_reduce(b.buffer, op="avg", group=self.group, async_op=True)

    def finish(self) -> None:
        """Waits for every bucket's reduction; buckets whose parameters got no gradient this
        iteration (unused layers) are reduced now, in order, so every rank agrees."""
        if not self.active:
            return
        for b in self.buckets:
            if b.work is None:
                b.work = dist.all_reduce(b.buffer, op="avg", group=self.group, async_op=True)
        for b in self.buckets:
            b.work.wait()
            b.work = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
