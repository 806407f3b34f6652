"""Data-parallel gradient averaging in buckets that start while backward is still running.

Gradients live in a few flat buffers (``param.grad`` is a view into one), filled in reverse
parameter order, the order backward produces them. A bucket is reduced as soon as every one of
its parameters has received its last gradient of the iteration (``expected`` backward passes
each, one per microbatch), while backward goes on with earlier layers.

With ``reduce_dtype`` (--grad-reduce-in-bf16) a bucket travels in that dtype: its sums are
rounded into a buffer of that dtype, reduced there, and copied back, so the bytes on the wire
halve; megart keeps accumulating the microbatches' gradients in fp32, where Megatron-LM's bf16
gradient buffer accumulates them in bf16 too.

With ``main_grads`` (--half-weights: 16-bit weights) the buffers are fp32 all the same, apart from
the parameters: a view of them is ``param.main_grad`` (Megatron-LM's name), and each backward's
16-bit ``param.grad`` is added into it and dropped as soon as autograd has written it (or a fused
weight gradient goes there directly: megart.tensor_parallel.weight_grad), so that the
microbatches' sum is an fp32 one and no 16-bit gradient outlives its backward.

Two reductions: an all-reduce leaves the average in every rank's whole buffer (each rank then
steps every parameter); with ``shard`` a reduce-scatter leaves it only in this rank's 1/dp
slice of each buffer (the distributed optimizer steps that slice alone, ZeRO stage 1). The rest
of a sharded buffer keeps this rank's own unreduced sums, which nothing reads.

A bucket's size is megart's (4 MiB, measured) unless --ddp-bucket-size or --ddp-num-buckets
asks for Megatron's: a number of elements (megatron_bucket_size), a bucket closing once it
holds that many or more, as Megatron-Core's closes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.errors import ConfigError


def megatron_bucket_size(
    num_parameters: int,
    dp: int,
    bucket_size: int | None = None,
    num_buckets: int | None = None,
    overlap: bool = True,
) -> int | None:
    """Megatron-LM's bucket size in elements (its training.py get_model, megatron-core
    0.16.1): ``num_parameters // num_buckets`` with --ddp-num-buckets (``num_parameters``:
    every parameter of this rank's model chunks), else --ddp-bucket-size, else
    max(4e7, 1e6 x ``dp``); None (no limit) without --overlap-grad-reduce. Refuses what
    Megatron-LM refuses: both flags, or fewer than one bucket."""
    if num_buckets is not None:
        if bucket_size is not None:
            raise ConfigError(
                f"--ddp-num-buckets {num_buckets} and --ddp-bucket-size {bucket_size} exclude "
                "each other (as in Megatron-LM); give one"
            )
        if num_buckets < 1:
            raise ConfigError(f"--ddp-num-buckets {num_buckets} must be at least 1")
        size: int | None = num_parameters // num_buckets
    elif bucket_size is not None:
        if bucket_size < 0:  # Megatron takes 0 (a bucket per parameter); below is meaningless
            raise ConfigError(f"--ddp-bucket-size {bucket_size} must be at least 0")
        size = bucket_size
    else:
        size = max(40_000_000, 1_000_000 * dp)
    return size if overlap else None


class _Bucket:
    """Parameters whose gradients share one flat buffer. ``offsets[i]`` is where ``params[i]``
    starts in it; the buffer is padded to a multiple of ``parts`` elements so that it splits
    into equal shards."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        parts: int,
        wire: torch.dtype | None = None,
        main_grads: bool = False,
    ) -> None:
        self.params = params
        device = params[0].device
        dtype = torch.float32 if main_grads else params[0].dtype
        numel = sum(p.numel() for p in params)
        padded = -(-numel // parts) * parts
        self.buffer = torch.zeros(padded, dtype=dtype, device=device)
        # What is reduced: the buffer itself, or its copy in the wire dtype.
        low = wire is not None and wire != dtype
        self.reduced = torch.empty(padded, dtype=wire, device=device) if low else self.buffer
        self.pending = len(params)
        self.work: dist.Work | None = None
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            view = self.buffer[offset : offset + p.numel()].view_as(p)
            if main_grads:
                p.main_grad = view
            else:
                p.grad = view
            offset += p.numel()

    def shard_range(self, rank: int, parts: int) -> tuple[int, int]:
        size = self.buffer.numel() // parts
        return rank * size, (rank + 1) * size


class GradientBuckets:
    """Averages the gradients of ``params`` over ``dp_group`` (None or size 1: nothing to do).

    Call :meth:`start_iteration` with the number of backward passes each parameter will see
    (the microbatches), run the backward passes, then :meth:`finish` to wait for the last
    reductions. Gradients accumulate across microbatches into the same buffers. With
    ``overlap`` False every bucket is reduced in :meth:`finish` instead (the baseline that
    bench/dp_overlap.py compares with). With ``shard`` only this rank's slice of each bucket is
    averaged (see the module docstring). Parameters in ``alone`` get a bucket of their own, so
    that their slices are the same on every stage that holds them (the tied embedding). With
    ``bucket_elements`` a bucket closes once it holds that many elements or more (Megatron's
    rule) instead of before it would pass ``bucket_bytes``. With ``main_grads`` the gradients
    are kept in fp32 as ``param.main_grad`` (see the module docstring). ``scale`` multiplies
    the averages (with or without a group to average over): expert parallelism's experts
    average over their expert-data-parallel ranks, times edp / (dp x cp) (training.expert_grads).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        dp_group: ProcessGroup | None,
        bucket_bytes: int = 4 << 20,
        overlap: bool = True,
        shard: bool = False,
        alone: Collection[torch.nn.Parameter] = (),
        reduce_dtype: torch.dtype | None = None,
        bucket_elements: int | None = None,
        main_grads: bool = False,
        scale: float = 1.0,
    ) -> None:
        self.group, self.scale = dp_group, scale
        self.main_grads = main_grads
        self.overlap = overlap
        self.shard = shard
        self.parts = dp_group.size() if (shard and dp_group is not None) else 1
        self.rank = dp_group.rank() if (shard and dp_group is not None) else 0
        params = [p for p in params if p.requires_grad]
        lone = {id(p) for p in alone}
        self.buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        grad_size = 4 if main_grads else None  # bytes per gradient element
        for p in reversed(params):
            nbytes = p.numel() * (grad_size or p.element_size())
            if bucket_elements is None:  # megart's: before this parameter would pass the bytes
                full = size + nbytes > bucket_bytes
            else:  # Megatron's: once the bucket holds that many elements, with no regard to p
                full = size >= bucket_elements
            if current and (
                full or p.dtype != current[0].dtype or id(p) in lone or id(current[0]) in lone
            ):
                self.buckets.append(_Bucket(current, self.parts, reduce_dtype, main_grads))
                current, size = [], 0
            current.append(p)
            size += p.numel() if bucket_elements is not None else nbytes
        if current:
            self.buckets.append(_Bucket(current, self.parts, reduce_dtype, main_grads))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._seen: dict[int, int] = {}
        self._expected = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @property
    def active(self) -> bool:
        return self.group is not None and self.group.size() > 1

    def bucket_of(self, p: torch.nn.Parameter) -> _Bucket:
        return self._bucket_of[id(p)]

    def shard_range(self, bucket: _Bucket) -> tuple[int, int]:
        """This rank's slice [start, end) of ``bucket``'s buffer (all of it without ``shard``)."""
        return bucket.shard_range(self.rank, self.parts)

    def owner(self, bucket: _Bucket) -> GradientBuckets:
        """The bucket set that reduces ``bucket`` (its ``group`` and ``parts``): this one
        (expert parallelism's two sets answer for each of theirs: training.expert_grads)."""
        return self

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()

    def start_iteration(self, backward_passes: int) -> None:
        self._expected = backward_passes
        self._seen = {}
        for b in self.buckets:
            b.pending, b.work = len(b.params), None

    def _reduce(self, b: _Bucket) -> dist.Work:
        if b.reduced is not b.buffer:
            b.reduced.copy_(b.buffer)
        if not self.shard:
            return dist.all_reduce(b.reduced, op="avg", group=self.group, async_op=True)
        start, end = self.shard_range(b)
        # In place: this rank's slice of the input is the output, as NCCL allows.
        return dist.reduce_scatter_tensor(
            b.reduced[start:end], b.reduced, op="avg", group=self.group, async_op=True
        )

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self.main_grads and p.grad is not None:  # None: a fused product wrote main_grad
            p.main_grad.add_(p.grad)
            p.grad = None
        n = self._seen.get(id(p), 0) + 1
        self._seen[id(p)] = n
        if n != self._expected:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0 and self.active and self.overlap:
            b.work = self._reduce(b)

    def finish(self) -> None:
        """Waits for every bucket's reduction; buckets whose parameters got no gradient this
        iteration (unused layers) are reduced now, in order, so every rank agrees."""
        if not self.active:
            self._scale()
            return
        for b in self.buckets:
            if b.work is None:
                b.work = self._reduce(b)
        for b in self.buckets:
            b.work.wait()
            b.work = None
            if b.reduced is not b.buffer:  # the average back where the optimizer reads it
                start, end = self.shard_range(b)
                b.buffer[start:end].copy_(b.reduced[start:end])
        self._scale()

    def _scale(self) -> None:
        if self.scale != 1.0:
            for b in self.buckets:
                b.buffer.mul_(self.scale)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
