"""Communication between ranks, with torch.distributed's function names.

>>> import megart.distributed as dist
>>> dist.init()                      # torchrun's environment, or a one-process world
>>> dist.all_reduce(t, op="sum")     # t: a CPU tensor on the shm transport
"""

from megart.distributed.group import (
    ProcessGroup,
    destroy,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    new_group,
)
from megart.distributed.nccl import find_nccl, load_nccl, nccl_candidates
from megart.distributed.ops import (
    P2POp,
    Work,
    abort,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    barrier,
    batch_isend_irecv,
    broadcast,
    bytes_sent,
    irecv,
    isend,
    recv,
    reduce_scatter_single,
    reduce_scatter_tensor,
    reset_bytes_sent,
    send,
)

__all__ = [
    "ProcessGroup",
    "P2POp",
    "Work",
    "init",
    "is_initialized",
    "destroy",
    "new_group",
    "get_rank",
    "get_world_size",
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "broadcast",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "bytes_sent",
    "reset_bytes_sent",
    "abort",
    "find_nccl",
    "load_nccl",
    "nccl_candidates",
]
