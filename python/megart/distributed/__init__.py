"""Communication between ranks (torch.distributed's names). NCCL is found at run time."""

from megart.distributed.nccl import find_nccl, load_nccl, nccl_candidates

__all__ = ["find_nccl", "load_nccl", "nccl_candidates"]
