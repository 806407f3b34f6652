"""Context parallelism: each sequence split over the ranks of a context-parallel group.

The split is Megatron's load-balanced one for causal attention: the sequence is cut into 2 cp
equal chunks and cp rank r holds chunks r and 2 cp - 1 - r, so that every rank holds as many
early (cheap) as late (costly) query positions. Tokens, targets and positions are split alike;
rope and learned position embeddings use each token's global position.

Attention needs the keys and values of every earlier token. Here they travel the simple, exact
way (Megatron-Core's cp_comm_type "all_gather"): each rank all-gathers K and V over the group in
the forward and reduce-scatters their gradients in the backward, and masks the scores by the
tokens' global positions. No ring (p2p) exchange: every rank holds the whole K and V for the
length of one layer's attention.
"""

from __future__ import annotations

import torch

from megart.distributed import ProcessGroup
from megart.errors import ConfigError
from megart.tensor_parallel._group import group_rank, group_size
from megart.tensor_parallel.mappings import gather_from_sequence_region


def cp_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2 cp chunks of a sequence that context-parallel rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def check_divisible(seq: int, cp: int) -> None:
    """A sequence of ``seq`` tokens splits into 2 cp equal chunks, or a ConfigError says so."""
    if seq % (2 * cp):
        fits = [n for n in (seq // (2 * cp) * 2 * cp, (seq // (2 * cp) + 1) * 2 * cp) if n]
        raise ConfigError(
            f"--seq-length {seq} is not divisible by 2 x --context-parallel-size {cp} = "
            f"{2 * cp} (context parallelism cuts each sequence into 2 cp equal chunks); use "
            f"--seq-length {' or '.join(map(str, fits))}, or another --context-parallel-size"
        )


def split_for_cp(x: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """``x``'s part along ``dim`` (the sequence) that ``cp_rank`` holds: chunks r and
    2 cp - 1 - r of 2 cp, in that order (Megatron's get_batch_on_this_cp_rank)."""
    if cp == 1:
        return x
    check_divisible(x.shape[dim], cp)
    pieces = x.chunk(2 * cp, dim)
    return torch.cat([pieces[i] for i in cp_chunks(cp, cp_rank)], dim)


def cp_positions(seq: int, cp: int, cp_rank: int, device: torch.device | None) -> torch.Tensor:
    """The global positions of the tokens ``cp_rank`` holds of a ``seq``-token sequence."""
    return split_for_cp(torch.arange(seq, device=device), 0, cp, cp_rank)


def group_positions(
    group: ProcessGroup | None, local: int, device: torch.device | None
) -> torch.Tensor:
    """The global positions of this rank's ``local`` tokens of each sequence."""
    cp = group_size(group)
    return cp_positions(local * cp, cp, group_rank(group), device)


def causal_mask(cp: int, cp_rank: int, local: int, device: torch.device | None) -> torch.Tensor:
    """[local, local x cp] booleans: query i of ``cp_rank`` may attend to gathered key j (keys in
    group-rank order, each rank's own split) when j's global position is not after i's."""
    queries = cp_positions(local * cp, cp, cp_rank, device)
    keys = torch.cat([cp_positions(local * cp, cp, r, device) for r in range(cp)])
    return keys.unsqueeze(0) <= queries.unsqueeze(1)


def gather_kv(x: torch.Tensor, group: ProcessGroup | None, dim: int = 2) -> torch.Tensor:
    """Every context-parallel rank's part of ``x`` (keys or values, [b, heads, s, d]) along
    ``dim``, in group-rank order; the identity without context parallelism. The backward
    reduce-scatters (sums) the gradient, since every rank's queries read every rank's keys and
    values: the sequence-parallel all-gather's autograd pair (megart.tensor_parallel), here
    over the context-parallel group."""
    return gather_from_sequence_region(x, group, dim, reduce_grad=True)
