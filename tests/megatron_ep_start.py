"""The start every launched Megatron-Core worker under expert parallelism shares: torch.distributed
over the launched ranks, Megatron-Core's parallel_state at tp x pp with an expert-model-parallel
size, and what it would put on CUDA kept on this CPU-only process (megatron_core_workers'
on_cpu_only, and no_cuda_streams here for its token dispatchers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import megart.distributed as dist
from megart.training.ckpt_files import rank_dir


@contextlib.contextmanager
def megatron_ep(tp: int, pp: int, ep: int, *, megart_groups: bool = False) -> Iterator[str]:
    """Megatron-Core's parallel state at ``tp`` x ``pp`` with ``ep`` expert-parallel ranks over
    this launched process's world (gloo), kept on the CPU, ended on exit. ``megart_groups``:
    the world started by megart.distributed's torch backend instead, so that megart's own
    groups share it. Yields this rank's folder in a legacy checkpoint of that layout."""
    from megatron.core import parallel_state as ps

    from megatron_core_workers import on_cpu_only

    if megart_groups:
        dist.init("torch", timeout=120)
    else:
        torch.distributed.init_process_group("gloo")
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    on_cpu_only()
    no_cuda_streams()
    try:
        t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        yield rank_dir(t, p, pp, ps.get_expert_model_parallel_rank(), ep)
    finally:
        ps.destroy_model_parallel()
        if megart_groups:
            dist.destroy()
        else:
            torch.distributed.destroy_process_group()


class _Stream:
    """A stand-in for a CUDA stream on this CPU-only process: Megatron-Core's alltoall
    dispatcher copies its split sizes to the host on a side stream, here already there."""

    def wait_stream(self, other: object) -> None:
        pass

    def record_event(self) -> _Stream:
        return self  # an event whose synchronize returns at once

    def synchronize(self) -> None:
        pass


def no_cuda_streams() -> None:
    """torch.cuda's streams as _Stream, and the split sizes the dispatcher would copy from the
    device as numpy arrays (once per process; these processes have no CUDA)."""
    from megatron.core.transformer.moe import token_dispatcher

    stream = _Stream()
    torch.cuda.Stream = lambda *a, **kw: stream
    torch.cuda.current_stream = lambda *a, **kw: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()

    def to_host(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    _uneven_collectives()


def _uneven_collectives() -> None:
    """torch.distributed's all_gather of pieces of unequal rows and list reduce_scatter, which
    the alltoall dispatcher calls over the tensor-parallel group and gloo lacks: the pieces
    padded and gathered, the list summed whole and sliced (the same sums: each element of
    two ranks' values added once)."""
    real_gather = torch.distributed.all_gather

    def all_gather(outputs: list, x: torch.Tensor, group: object = None, async_op: bool = False):
        if all(o.shape == x.shape for o in outputs):
            return real_gather(outputs, x, group=group, async_op=async_op)
        padded = x.new_zeros((max(len(o) for o in outputs), *x.shape[1:]))
        padded[: len(x)] = x
        parts = [torch.empty_like(padded) for _ in outputs]
        real_gather(parts, padded, group=group)
        for out, part in zip(outputs, parts, strict=True):
            out.copy_(part[: len(out)])

    def reduce_scatter(output: torch.Tensor, inputs: list, group: object = None, **kw: object):
        whole = torch.cat(inputs)
        torch.distributed.all_reduce(whole, group=group)
        rank = torch.distributed.get_rank(group)
        output.copy_(whole.split([len(t) for t in inputs])[rank])

    torch.distributed.all_gather = all_gather
    torch.distributed.reduce_scatter = reduce_scatter
