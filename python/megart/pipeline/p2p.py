"""Moving activations and gradients between pipeline stages, with the scatter/gather
optimisation: when a tensor is replicated across the t tensor-parallel ranks, each sends only
its 1/t slice to the same tensor-parallel rank of the next stage (each GPU has its own network
rail), and the receiver rebuilds the whole tensor with an all-gather inside its node."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.errors import ConfigError


@dataclass(frozen=True)
class StageLink:
    """How this rank talks to its pipeline neighbours. Peers are global ranks; the pipeline
    group carries the point-to-point traffic, so its byte counters measure exactly that."""

    pp_group: ProcessGroup | None
    tp_group: ProcessGroup | None = None
    scatter_gather: bool = True

    @property
    def tp_size(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1

    def slicing(self, numel: int) -> bool:
        """Whether this tensor travels as 1/t slices."""
        if not self.scatter_gather or self.tp_size == 1:
            return False
        if numel % self.tp_size:
            raise ConfigError(
                f"scatter/gather splits inter-stage tensors into {self.tp_size} slices, but a "
                f"tensor of {numel} elements does not divide; change the shape or pass "
                "--no-scatter-gather-tensors-in-pipeline"
            )
        return True

    def wire_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The buffer a receive fills: the whole tensor, or this rank's slice of it."""
        n = like.numel() // self.tp_size if self.slicing(like.numel()) else like.numel()
        return torch.empty(n, dtype=like.dtype, device=like.device)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """What a send carries: the tensor, or this tensor-parallel rank's slice of it."""
        flat = t.detach().contiguous().view(-1)
        if not self.slicing(flat.numel()):
            return flat
        part = flat.numel() // self.tp_size
        r = self.tp_group.rank()
        return flat[r * part : (r + 1) * part].contiguous()

    def from_wire(self, received: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The whole tensor from what arrived: all-gathers the slices across tensor parallel."""
        if not self.slicing(like.numel()):
            return received.view(like.shape)
        whole = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        dist.all_gather_into_tensor(whole, received, group=self.tp_group)
        return whole.view(like.shape)

    def post(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        return dist.batch_isend_irecv(ops) if ops else []

    def send_op(self, t: torch.Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(dist.isend, self.to_wire(t), peer, self.pp_group)

    def recv_op(self, buffer: torch.Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(dist.irecv, buffer, peer, self.pp_group)
