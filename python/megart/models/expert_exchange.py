"""Expert parallelism's token exchange (Megatron-Core's MoEAlltoAllTokenDispatcher): each rank
of the expert-model-parallel group holds num_experts / ep of every MoE layer's experts (global
expert ep_rank x E/ep + local), and routes its own tokens; the copies of each token for its
chosen experts travel to those experts' owners, run there, and come back to be summed with the
routing weights.

Under tensor parallelism (the expert tensor-parallel size equal to it) the tokens given here are
already gathered over the tensor-parallel group (models.moe), and the group here holds the
ranks of the same tensor-parallel rank (parallel.experts), whose experts' shards are the same
tensor-parallel piece: each expert shard gets every token of the tp x ep ranks that chose it,
and the partial outputs that come back are summed over the tensor-parallel group by the
caller's reduce-scatter. The result is Megatron-Core's dispatchers' with etp = tp (its
alltoall dispatcher exchanges first and gathers over tp after; the rows each expert shard sees
are the same tokens).

One exchange is an all-to-all with uneven splits (megart.distributed.all_to_all, as
models.all_to_all_attention's): first the counts (how many rows each rank sends each of
the receiver's experts), then the rows. Its gradient is the same exchange reversed.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup


def rows_by_expert(chosen: torch.Tensor) -> list[torch.Tensor]:
    """Each expert's tokens (the rows of the [T, E] routing map ``chosen`` that chose it), in
    token order, as views of one index: one nonzero over the map and one count, two host syncs
    whatever the number of experts (a nonzero per expert would be one each), in
    Megatron-Core's permute order (by expert, then token)."""
    experts, rows = chosen.t().nonzero(as_tuple=True)
    counts = torch.bincount(experts, minlength=chosen.shape[1]).tolist()
    return list(rows.clone().split(counts))  # its own storage: the pairs' [2, n] is freed


def exchange(
    x: torch.Tensor, group: ProcessGroup, send: list[int], receive: list[int]
) -> torch.Tensor:
    """``x``'s rows cut into pieces of ``send`` rows, piece j sent to group rank j; the pieces
    received (``receive[i]`` rows from rank i) joined in group-rank order. Empty pieces are
    not sent (both sides know the counts)."""
    me = group.rank()
    pieces = list(x.split(send))
    received = [x.new_empty((n, *x.shape[1:])) for n in receive]
    received[me] = pieces[me]
    dist.all_to_all(received, pieces, group)
    return torch.cat(received)


class Exchange(torch.autograd.Function):
    """exchange, whose gradient is the exchange reversed."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup, send: list[int], receive: list[int]
    ) -> torch.Tensor:
        ctx.group, ctx.splits = group, (send, receive)
        return exchange(x, group, send, receive)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        send, receive = ctx.splits
        return exchange(grad.contiguous(), ctx.group, receive, send), None, None, None


def expert_parallel_mlp(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    chosen: torch.Tensor,
    experts: list[tuple[int, torch.nn.Module]],
    group: ProcessGroup,
    grouped: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The MoE layer's output for this rank's ``tokens`` [T, h] (routing weights ``probs`` and
    choices ``chosen``, [T, E]), its ``experts`` (global index, MLP) this rank's share of the
    E, in order: each (token, expert) copy sent to the expert's owner with its routing weight,
    run there, sent back and summed in expert order, as one process sums them. ``grouped``
    (--moe-grouped-gemm): runs all the local experts at once on (rows sorted by local expert,
    their routing weights, rows per expert) in place of one call per expert."""
    ep, num_experts = group.size(), chosen.shape[1]
    local = num_experts // ep
    rows = rows_by_expert(chosen)
    sizes = [len(r) for r in rows]
    counts = torch.tensor(sizes, dtype=torch.int64, device=tokens.device)
    # What each rank sends each of my experts, by source then local expert (one host sync).
    incoming = exchange(counts, group, [local] * ep, [local] * ep).tolist()
    send = [sum(sizes[r * local : (r + 1) * local]) for r in range(ep)]
    receive = [sum(incoming[s * local : (s + 1) * local]) for s in range(ep)]
    order = torch.cat(rows)
    weights = torch.cat([probs[r, e] for e, r in enumerate(rows)])
    x = Exchange.apply(tokens[order], group, send, receive)
    w = Exchange.apply(weights, group, send, receive)
    # Received by source, then expert; each expert runs on its rows of every source, in
    # source order.
    starts = [0, *accumulate(incoming)]
    spans = [
        [(starts[s * local + j], incoming[s * local + j]) for s in range(ep)] for j in range(local)
    ]
    places = [
        torch.cat([torch.arange(a, a + n, device=tokens.device) for a, n in span]) for span in spans
    ]
    if grouped is not None:
        idx = torch.cat(places)
        outputs = [grouped(x[idx], w[idx], [len(i) for i in places])]
    else:  # every expert runs, on no rows too
        experts_ = [expert for _, expert in experts]
        outputs = [m(x[i], scale=w[i]) for m, i in zip(experts_, places, strict=True)]
    y = outputs[0].new_zeros((x.shape[0], outputs[0].shape[1]))
    y = y.index_copy(0, torch.cat(places), torch.cat(outputs))
    back = Exchange.apply(y, group, receive, send)
    out = tokens.new_zeros(tokens.shape, dtype=back.dtype)
    for r, part in zip(rows, back.split([len(r) for r in rows]), strict=True):
        out = out.index_add(0, r, part)
    return out
