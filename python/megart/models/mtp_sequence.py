"""Multi-token prediction's shifts under context parallelism (models.mtp): depth k reads the
tokens, positions, labels and loss mask shifted left by k along the whole sequence, what
Megatron-Core's roll_tensor gives over its cp group (each rank's two chunks rolled, the
element each chunk lacks at its end taken from the chunk after it in the sequence, zero after
the sequence's last).

A rank's [b, s/cp] part (chunks r and 2 cp - 1 - r, models.context_parallel) cannot be shifted
alone: the end of each chunk needs the start of the next, held by another rank (chunk 2 cp - 1
ends the sequence). Here each such tensor is all-gathered over the context-parallel group once
per microbatch, put in the sequence's order, shifted as one process shifts it, and each rank
keeps its part of every shift (SequenceParts). The tensors are integers or a mask, [b, s]:
1/h of one layer's activations, and without gradients; one gather serves every depth, where
Megatron-Core exchanges two boundary elements per depth and tensor."""

from __future__ import annotations

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.models.context_parallel import in_sequence_order, split_for_cp
from megart.tensor_parallel._group import group_rank, group_size


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """``x`` [b, s] shifted left by one along the sequence, a zero shifted in at the end
    (Megatron-Core's roll_tensor without context parallelism)."""
    out = torch.zeros_like(x)
    out[..., :-1] = x[..., 1:]
    return out


class SequenceParts:
    """A context-parallel rank's view of [b, s] tensors of the whole sequence: ``whole`` of its
    part (gathered), ``part`` of a whole one (its chunks); the identity without a group."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group, self.cp, self.rank = group, group_size(group), group_rank(group)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's part of ``x`` [b, s/cp] put together: [b, s], in the sequence's order."""
        if self.cp == 1:
            return x
        send = x.to(torch.uint8) if x.dtype == torch.bool else x.contiguous()
        out = torch.empty((self.cp, *send.shape), dtype=send.dtype, device=send.device)
        dist.all_gather_into_tensor(out, send, group=self.group)
        # [cp, b, s/cp] -> [b, s] in group-rank order (rank r's chunks r, 2 cp - 1 - r), then
        # in the sequence's.
        ranked = out.permute(1, 0, 2).reshape(x.shape[0], -1)
        return in_sequence_order(ranked, self.cp, dim=1).to(x.dtype)

    def part(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``x`` [b, s] (the whole sequence)."""
        return split_for_cp(x, 1, self.cp, self.rank)

    def count_share(self, mask: torch.Tensor) -> torch.Tensor:
        """What each rank divides its part of a sum over ``mask`` (the whole sequence's) by, so
        that the cp ranks' mean is the whole mean: the mask's count (at least 1) over cp."""
        return mask.sum().clamp(min=1) / self.cp

    def shifts(self, x: torch.Tensor, n: int) -> list[torch.Tensor]:
        """This rank's parts of ``x`` [b, s/cp] (its part) shifted left by 1, ..., ``n`` along
        the whole sequence."""
        full = self.whole(x)
        out = []
        for _ in range(n):
            full = shift_left(full)
            out.append(self.part(full))
        return out
