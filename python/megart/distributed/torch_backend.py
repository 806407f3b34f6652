"""``backend="torch"``: megart's communication API delegating to torch.distributed's process
groups (gloo for CPU tensors, NCCL for CUDA tensors). It is the fallback for a machine where
megart's own transport fails (``--distributed-backend torch``) and an independent reference
that megart's transports are tested against.

A group on this backend holds a :class:`TorchComm` as its ``comm``: it answers what the rest of
megart asks a communicator (rank, barrier, bytes_sent, abort); the tensor ops of
:mod:`megart.distributed.ops` hand their tensors to the functions below."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as td

from megart.distributed.rendezvous import key_prefix
from megart.errors import CommError, ConfigError

# torch.distributed's name for the process-group backend that moves each kind of tensor.
_INNER = {"cpu": "gloo", "cuda": "nccl"}
_started = False  # whether init_world started torch.distributed (then destroy() ends it)


def inner_backend() -> str:
    """gloo, or NCCL when torch sees a GPU (as megart picks nccl then)."""
    return _INNER["cuda" if torch.cuda.is_available() else "cpu"]


def device() -> int | None:
    """The CUDA device this process communicates from (NCCL), or None (gloo, host tensors)."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def init_world(
    store: object, rank: int, world_size: int, local_rank: int, timeout: timedelta
) -> None:
    """Starts torch.distributed's default group over megart's store (its keys under a prefix of
    their own), on GPU LOCAL_RANK when torch sees one. A job that already started
    torch.distributed keeps its default group."""
    if torch.cuda.is_available():
        if not 0 <= local_rank < torch.cuda.device_count():
            raise ConfigError(
                f"LOCAL_RANK={local_rank} but this process sees {torch.cuda.device_count()} "
                "GPU(s); launch one process per GPU"
            )
        torch.cuda.set_device(local_rank)
    if td.is_initialized():
        if td.get_world_size() != world_size or td.get_rank() != rank:
            raise ConfigError(
                f"torch.distributed is already initialised as rank {td.get_rank()} of "
                f"{td.get_world_size()}, not {rank} of {world_size}"
            )
        return
    global _started
    _started = True
    td.init_process_group(
        backend=inner_backend(),
        # Under megart's keys of this init: torchrun's store outlives a destroy(), and a
        # second init_process_group on the last one's keys waits on ranks that left.
        store=td.PrefixStore(key_prefix() + "torch/", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def shutdown(comms: Sequence[object]) -> None:
    """megart's destroy(), given the communicators of the groups it ended: each of this
    backend's lets go of its torch.distributed group, and torch.distributed's default group
    ends if init_world started it."""
    global _started
    # A torch group a caller's megart group still holds would otherwise live until the
    # interpreter's shutdown, where gloo's destructor can abort the process after a clean run
    # ("terminate called without an active exception"; 2 runs in 16 under load).
    for comm in comms:
        if isinstance(comm, TorchComm):
            comm.pg = None
    if _started and td.is_initialized():
        td.destroy_process_group()
    _started = False


class TorchComm:
    """One torch.distributed process group seen through megart's communicator interface."""

    def __init__(self, pg: object, rank: int, size: int, name: str) -> None:
        self.pg = pg
        self.rank = rank
        self.size = size
        self.name = name
        self._sent = [0] * size
        self._aborted = False

    def check_alive(self, what: str) -> None:
        if self._aborted:
            raise CommError(f"{what}: group '{self.name}' was aborted")
        # Ops reach here through ops.py, which refuses an ended group first; this only keeps
        # a released group from becoming torch's default one (group=None) by some other path.
        if self.pg is None:
            raise CommError(f"{what}: group '{self.name}' ended with destroy()")

    def count_sent(self, peer: int, nbytes: int) -> None:
        self._sent[peer] += nbytes

    def bytes_sent(self) -> list[int]:
        return list(self._sent)

    def reset_bytes_sent(self) -> None:
        self._sent = [0] * self.size

    def barrier(self) -> TorchWork:
        self.check_alive("barrier")
        # NCCL's barrier is an all-reduce of one element on a GPU: this rank's own (init_world
        # set it), named so that torch need not take "the current device" and warn that it did.
        ids = [torch.cuda.current_device()] if td.get_backend(self.pg) == "nccl" else None
        return TorchWork(td.barrier(group=self.pg, async_op=True, device_ids=ids))

    def abort(self) -> None:
        # torch's groups cannot be aborted portably (gloo has no abort): later ops here raise.
        self._aborted = True


def make_comm(ranks: list[int], rank: int, name: str) -> TorchComm | None:
    """Every process calls this for every group, as torch.distributed.new_group requires;
    returns None outside the group."""
    world = ranks == list(range(td.get_world_size()))
    pg = td.group.WORLD if world else td.new_group(ranks)
    if rank not in ranks:
        return None
    return TorchComm(pg, ranks.index(rank), len(ranks), name)


class TorchWork:
    """A torch.distributed Work, with what must happen once it has finished (the division of
    ``avg`` where the inner backend cannot average, the copy out of a staging buffer)."""

    def __init__(self, work: Any, then: Callable[[], None] | None = None) -> None:
        self._work = work
        self._then = then

    def _done(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def wait(self) -> bool:
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as e:
                raise CommError(f"torch.distributed: {e}") from e
            # torch's NCCL wait orders the current stream only; megart's wait blocks the host.
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.current_stream().synchronize()
        self._done()
        return True

    def is_completed(self) -> bool:
        if self._work is None or self._work.is_completed():
            if self._then is not None:
                self.wait()
            return True
        return False


# torch 2.13 renamed the two (the old names warn); older torch has only the old ones.
_all_gather = getattr(td, "all_gather_single", None) or td.all_gather_into_tensor
_reduce_scatter = getattr(td, "reduce_scatter_single", None) or td.reduce_scatter_tensor
_TORCH_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "avg": "SUM"}


def _average(tensor: torch.Tensor, n: int) -> Callable[[], None]:
    # megart's avg: the sum divided by the group size, truncated for integers (as in C++).
    if tensor.is_floating_point():
        return lambda: tensor.div_(n)
    return lambda: tensor.div_(n, rounding_mode="trunc")


def all_reduce(tensor: torch.Tensor, op: str, comm: TorchComm) -> TorchWork:
    comm.check_alive("all_reduce")
    w = td.all_reduce(tensor, op=getattr(td.ReduceOp, _TORCH_OPS[op]), group=comm.pg, async_op=True)
    return TorchWork(w, _average(tensor, comm.size) if op == "avg" else None)


def all_gather(output: torch.Tensor, input: torch.Tensor, comm: TorchComm) -> TorchWork:
    comm.check_alive("all_gather_into_tensor")
    w = _all_gather(output.view(-1), input.view(-1), group=comm.pg, async_op=True)
    return TorchWork(w)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, comm: TorchComm
) -> TorchWork:
    comm.check_alive("reduce_scatter_tensor")
    if input.is_cuda:
        w = _reduce_scatter(
            output.view(-1),
            input.view(-1),
            op=getattr(td.ReduceOp, _TORCH_OPS[op]),
            group=comm.pg,
            async_op=True,
        )
        return TorchWork(w, _average(output, comm.size) if op == "avg" else None)
    # gloo has no reduce-scatter: all-reduce a copy of the input, keep this rank's slice.
    staged = input.reshape(-1).clone()
    w = td.all_reduce(staged, op=getattr(td.ReduceOp, _TORCH_OPS[op]), group=comm.pg, async_op=True)
    n = output.numel()

    def keep() -> None:
        output.view(-1).copy_(staged[comm.rank * n : (comm.rank + 1) * n])
        if op == "avg":
            _average(output, comm.size)()

    return TorchWork(w, keep)


def broadcast(tensor: torch.Tensor, src: int, comm: TorchComm) -> TorchWork:
    comm.check_alive("broadcast")
    return TorchWork(td.broadcast(tensor, src=src, group=comm.pg, async_op=True))


def batch_p2p(
    ops: Sequence[tuple[bool, torch.Tensor, int, int]], comm: TorchComm
) -> list[TorchWork]:
    """``ops``: (is_send, tensor, global peer, peer's rank in the group). All are posted before
    any is waited on; returns one Work per op."""
    comm.check_alive("batch_isend_irecv")
    p2p = [
        td.P2POp(td.isend if send else td.irecv, t, peer, group=comm.pg) for send, t, peer, _ in ops
    ]
    for send, t, _, q in ops:
        if send:
            comm.count_sent(q, t.numel() * t.element_size())
    works = td.batch_isend_irecv(p2p)
    if len(works) != len(ops):  # NCCL coalesces a batch into one Work: each op waits on it
        return [TorchWork(works[0]) for _ in ops]
    return [TorchWork(w) for w in works]
