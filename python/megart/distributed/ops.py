"""Collectives and point-to-point ops on torch tensors, with torch.distributed's names and
signatures. Ranks are global ranks, as in torch. Tensors are checked before anything is sent.

Groups on the shm transport take CPU tensors; groups on the nccl transport (run on one GPU only: one
rank, and two ranks sharing it) take CUDA tensors on the group's device. nccl ops are ordered after
the work already queued on the caller's current CUDA stream. As in torch.distributed, an nccl op
with ``async_op=False`` returns once it is enqueued, with the caller's stream ordered after it, so
the host runs ahead of the GPU; ``Work.wait()`` does the same for an async op, as
torch.distributed's does: the current stream waits for the op on the device, the host goes on
(``Work.wait_stream(stream)`` names another stream, ``Work.synchronize()`` blocks the host). On the
shm transport the op is on host memory, and every wait blocks the host (raising CommError or
CommTimeoutError rather than hanging). An nccl op that fails or is still unfinished after the
group's timeout is found by the process's watchdog, which aborts the group and ends the process
naming the op (with ``MEGART_NCCL_WATCHDOG=0``: when the group is next used, raising
CommTimeoutError).

Tensors stay referenced until their op has completed: by the Work until ``wait()`` returns or
``is_completed()`` is true, and after ``wait_stream()`` (or when a Work is dropped unfinished) by
the group, which lets them go once the op has completed, so the caching allocator never hands
their memory out while NCCL uses it.

On the nccl transport, ops posted in separate calls run one after another in the order posted
(NCCL serialises a communicator's kernels): a send and a receive that must progress together,
such as an exchange between two ranks or any send to or receive from the same rank, go in one
:func:`batch_isend_irecv`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megart._core import comm as _comm
from megart.distributed import torch_backend as _tb
from megart.distributed import work as _work
from megart.distributed.group import ProcessGroup, context, resolve
from megart.distributed.work import Work
from megart.errors import ConfigError

_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}
_OPS = ("sum", "avg", "max", "min")


def _reduce_op(op: object) -> str:
    name = getattr(op, "name", op)  # torch.distributed.ReduceOp.SUM -> "SUM"
    name = str(name).lower().replace("reduceop.", "")
    if name not in _OPS:
        raise ConfigError(f"reduction {op!r} is not supported; use one of {', '.join(_OPS)}")
    return name


def _check(tensor: torch.Tensor, what: str, group: ProcessGroup) -> str:
    # The common case first, with cheap attribute reads only (every op pays for this check).
    dtype = _DTYPES.get(getattr(tensor, "dtype", None))
    nccl = group.device is not None  # nccl groups, and torch groups over NCCL (GPU tensors)
    if (
        dtype is not None
        and (tensor.is_cuda if nccl else tensor.is_cpu)
        and (not nccl or tensor.device.index == group.device)
        and tensor.is_contiguous()
    ):
        return dtype
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if nccl:
        if tensor.device.type != "cuda":
            raise ConfigError(
                f"{what}: the tensor is on {tensor.device}, but group '{group.name}' uses the "
                f"{group.backend} transport on GPUs, which moves GPU memory; move it to "
                f"cuda:{group.device} (tensor.cuda()) or use a group with backend='shm'"
            )
        if tensor.device.index != group.device:
            raise ConfigError(
                f"{what}: the tensor is on {tensor.device}, but this rank of group "
                f"'{group.name}' communicates from cuda:{group.device}"
            )
    elif tensor.device.type != "cpu":
        raise ConfigError(
            f"{what}: the tensor is on {tensor.device}, but group '{group.name}' uses the "
            f"{group.backend} transport, which moves host memory; use CPU tensors"
        )
    if not tensor.is_contiguous():
        raise ConfigError(f"{what}: the tensor is not contiguous; pass tensor.contiguous()")
    raise ConfigError(
        f"{what}: dtype {tensor.dtype} cannot be communicated; use one of "
        + ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)
    )


def _member(group: ProcessGroup | None, what: str) -> ProcessGroup:
    g = resolve(group)
    if g.comm is None:
        raise ConfigError(f"{what}: rank {context().rank} is not a member of group '{g.name}'")
    return g


def _stream(g: ProcessGroup) -> int:
    """The caller's current stream on the group's device (nccl), as NCCL's ops take it."""
    if g.backend != "nccl":
        return 0
    return _work.current_stream(g.device).cuda_stream


def _finish(
    work: object, tensors: Sequence[torch.Tensor], async_op: bool, g: ProcessGroup
) -> Work | None:
    w = Work(work, tensors, g)
    if async_op:
        return w
    w.wait()  # nccl: ordered on the current stream, host free; shm: done on return
    return None


def all_reduce(
    tensor: torch.Tensor,
    op: object = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduces ``tensor`` across the group in place (sum, avg, max or min)."""
    g = _member(group, "all_reduce")
    dtype = _check(tensor, "all_reduce", g)
    if g.backend == "torch":
        return _finish(_tb.all_reduce(tensor, _reduce_op(op), g.comm), [tensor], async_op, g)
    work = g.comm.all_reduce(
        tensor.data_ptr(), tensor.numel(), dtype, _reduce_op(op), stream=_stream(g)
    )
    return _finish(work, [tensor], async_op, g)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Concatenates every rank's ``input_tensor`` into ``output_tensor`` in rank order."""
    g = _member(group, "all_gather_into_tensor")
    dtype = _check(input_tensor, "all_gather_into_tensor input", g)
    if _check(output_tensor, "all_gather_into_tensor output", g) != dtype:
        raise ConfigError("all_gather_into_tensor: output and input dtypes differ")
    if output_tensor.numel() != input_tensor.numel() * g.size():
        raise ConfigError(
            f"all_gather_into_tensor: the output must hold group size ({g.size()}) x input "
            f"({input_tensor.numel()}) = {input_tensor.numel() * g.size()} elements, "
            f"not {output_tensor.numel()}"
        )
    if g.backend == "torch":
        work = _tb.all_gather(output_tensor, input_tensor, g.comm)
        return _finish(work, [output_tensor, input_tensor], async_op, g)
    work = g.comm.all_gather(
        input_tensor.data_ptr(),
        output_tensor.data_ptr(),
        input_tensor.numel(),
        dtype,
        stream=_stream(g),
    )
    return _finish(work, [output_tensor, input_tensor], async_op, g)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: object = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduces ``input`` across the group and leaves this rank's slice in ``output``."""
    g = _member(group, "reduce_scatter_tensor")
    dtype = _check(input, "reduce_scatter_tensor input", g)
    if _check(output, "reduce_scatter_tensor output", g) != dtype:
        raise ConfigError("reduce_scatter_tensor: output and input dtypes differ")
    if input.numel() != output.numel() * g.size():
        raise ConfigError(
            f"reduce_scatter_tensor: the input must hold group size ({g.size()}) x output "
            f"({output.numel()}) = {output.numel() * g.size()} elements, not {input.numel()}"
        )
    if g.backend == "torch":
        work = _tb.reduce_scatter(output, input, _reduce_op(op), g.comm)
        return _finish(work, [output, input], async_op, g)
    work = g.comm.reduce_scatter(
        input.data_ptr(),
        output.data_ptr(),
        output.numel(),
        dtype,
        _reduce_op(op),
        stream=_stream(g),
    )
    return _finish(work, [output, input], async_op, g)


# torch 2.13's names for the same two ops.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def broadcast(
    tensor: torch.Tensor, src: int, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Copies global rank ``src``'s ``tensor`` to every rank of the group."""
    g = _member(group, "broadcast")
    dtype = _check(tensor, "broadcast", g)
    if g.backend == "torch":
        return _finish(_tb.broadcast(tensor, src, g.comm), [tensor], async_op, g)
    work = g.comm.broadcast(
        tensor.data_ptr(), tensor.numel(), dtype, g.group_rank(src), stream=_stream(g)
    )
    return _finish(work, [tensor], async_op, g)


def barrier(group: ProcessGroup | None = None) -> None:
    """Returns once every rank of the group has called it."""
    _member(group, "barrier").comm.barrier().wait()


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> Work:
    """Starts sending ``tensor`` to global rank ``dst``."""
    return batch_isend_irecv([P2POp(isend, tensor, dst, group)])[0]


def irecv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> Work:
    """Starts receiving into ``tensor`` from global rank ``src``."""
    return batch_isend_irecv([P2POp(irecv, tensor, src, group)])[0]


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup | None = None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup | None = None) -> int:
    irecv(tensor, src, group).wait()
    return src


@dataclass(slots=True)
class P2POp:
    """One send or receive of a batch: ``op`` is :func:`isend` or :func:`irecv`."""

    op: Callable[..., Work]
    tensor: torch.Tensor
    peer: int
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv):
            raise ConfigError("P2POp.op must be megart.distributed.isend or irecv")


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Posts every op before any waits, so they progress together: a ring exchange in both
    directions never deadlocks. Returns one Work per op, in order."""
    if p2p_op_list:
        g = resolve(p2p_op_list[0].group)
        if g.backend == "shm" and g.comm is not None:
            # One C++ call checks and posts a batch of one group's host tensors; it declines
            # (posting nothing) whatever the checked path below must look at or explain.
            if g.p2p_batcher is None:
                g.p2p_batcher = _comm.P2PBatcher(
                    g.comm, g.ranks, _DTYPES, isend, irecv, is_world=g is context().world
                )
            works = g.p2p_batcher.post(p2p_op_list)
            if works is not None:
                return works
    return _batch_checked(p2p_op_list)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: ProcessGroup | None = None,
) -> None:
    """torch.distributed.all_to_all's exchange: ``input_tensor_list[j]`` to group rank j,
    ``output_tensor_list[i]`` filled from group rank i (this rank's own piece copied, unless
    it is the input itself), built from batched point-to-point ops. Pieces may differ in size
    (both sides know them); an empty one travels as no message."""
    g = resolve(group)
    me = g.rank()
    if output_tensor_list[me] is not input_tensor_list[me]:
        output_tensor_list[me].copy_(input_tensor_list[me])
    ops = []
    for j, peer in enumerate(g.ranks):
        if j == me:
            continue
        if input_tensor_list[j].numel():
            ops.append(P2POp(isend, input_tensor_list[j].contiguous(), peer, group))
        if output_tensor_list[j].numel():
            ops.append(P2POp(irecv, output_tensor_list[j], peer, group))
    for work in batch_isend_irecv(ops):
        work.wait()


def _batch_checked(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """batch_isend_irecv with every check in Python: ops of several groups, nccl groups, and
    bad arguments (the error names what is wrong before anything is sent)."""
    groups = [_member(p.group, "batch_isend_irecv") for p in p2p_op_list]
    works: list[Work | None] = [None] * len(p2p_op_list)
    for g in {id(g): g for g in groups}.values():
        indices = [i for i, gi in enumerate(groups) if gi is g]
        ops = []
        for i in indices:
            p = p2p_op_list[i]
            send = p.op is isend
            dtype = _check(p.tensor, "isend" if send else "irecv", g)
            ops.append((send, p.tensor.data_ptr(), p.tensor.numel(), dtype, g.group_rank(p.peer)))
        if g.backend == "torch":
            posted = _tb.batch_p2p(
                [
                    (o[0], p2p_op_list[i].tensor, p2p_op_list[i].peer, o[4])
                    for i, o in zip(indices, ops, strict=True)
                ],
                g.comm,
            )
        else:
            posted = g.comm.batch_p2p(ops, stream=_stream(g))
        for i, w in zip(indices, posted, strict=True):
            works[i] = Work(w, [p2p_op_list[i].tensor], g)
    return works  # type: ignore[return-value]


def bytes_sent(group: ProcessGroup | None = None) -> dict[int, int]:
    """Bytes this rank has sent to each global rank by point-to-point ops in ``group``."""
    g = _member(group, "bytes_sent")
    return {g.ranks[q]: n for q, n in enumerate(g.comm.bytes_sent())}


def reset_bytes_sent(group: ProcessGroup | None = None) -> None:
    _member(group, "reset_bytes_sent").comm.reset_bytes_sent()


def abort(group: ProcessGroup | None = None) -> None:
    """Fails every op in flight in the group, on every rank: they raise instead of waiting."""
    _member(group, "abort").comm.abort()
