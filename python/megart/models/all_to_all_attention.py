"""All-to-all context parallelism (Megatron-Core's cp_comm_type "a2a", DeepSpeed Ulysses):
heads scattered over the context-parallel group, the sequence gathered.

Each rank holds its s/cp tokens (chunks r and 2 cp - 1 - r, megart.models.context_parallel) of
every local head. One all-to-all per tensor gives each rank 1/cp of the heads (and of the
query groups: both must divide by cp) for the whole sequence; after putting the chunks in the
sequence's order it runs one process's causal attention (torch's kernels: flash on a GPU; with
a sliding window the same explicit mask as one process, megart.models.window), and a last
all-to-all returns each rank its own tokens of every head. The backward is the same exchanges
reversed. The all-to-all is built from megart's batched point-to-point ops (each rank sends
one piece to every other rank and receives one from each, all posted together).
"""

from __future__ import annotations

from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.models.context_parallel import in_sequence_order, split_for_cp
from megart.models.window import sequence_attention


def all_to_all(x: torch.Tensor, group: ProcessGroup, split_dim: int, cat_dim: int) -> torch.Tensor:
    """``x`` cut into cp pieces along ``split_dim``, piece j sent to group rank j; the pieces
    received, one from each rank, joined along ``cat_dim`` in group-rank order."""
    cp, me = group.size(), group.rank()
    pieces = [p.contiguous() for p in x.chunk(cp, split_dim)]
    received = [torch.empty_like(p) for p in pieces]
    received[me] = pieces[me]
    dist.all_to_all(received, pieces, group)
    return torch.cat(received, cat_dim)


class AllToAll(torch.autograd.Function):
    """all_to_all, whose gradient is the exchange reversed."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, split_dim: int, cat_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dims = group, (split_dim, cat_dim)
        return all_to_all(x, group, split_dim, cat_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        split_dim, cat_dim = ctx.dims
        return all_to_all(grad, ctx.group, cat_dim, split_dim), None, None, None


def in_rank_order(x: torch.Tensor, cp: int, dim: int = 2) -> torch.Tensor:
    """The inverse of in_sequence_order: a whole sequence along ``dim`` as the ranks hold it,
    rank 0's two chunks first."""
    return torch.cat([split_for_cp(x, dim, cp, r) for r in range(cp)], dim)


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    dropout: float = 0.0,
    window: int | None = None,
    *,
    scale: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this context-parallel rank's queries ([b, heads, s/cp, d]) over the
    sequence, from every rank's own keys and values ([b, groups, s/cp, d]; heads and groups
    divisible by cp), by all-to-all exchanges over ``group`` (see the module's docstring);
    within ``window`` earlier tokens (None: all), by positions in the whole sequence; ``scale``
    the scores' factor (None: 1/sqrt of the queries' width). Each tensor travels at its own
    width: multi-latent attention's values are narrower than its queries and keys."""
    cp = group.size()
    q, k, v = (in_sequence_order(AllToAll.apply(x, group, 1, 2), cp) for x in (q, k, v))
    per_group = q.shape[1] // k.shape[1]
    if per_group > 1:  # each group's K/V once per query head of the group, as Attention does
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
    part = None if sink is None else sink.chunk(cp)[group.rank()]
    y = sequence_attention(q, k, v, dropout, window, scale=scale, sink=part)
    return AllToAll.apply(in_rank_order(y, cp), group, 2, 1)
