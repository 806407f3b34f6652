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

from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup


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
) -> torch.Tensor:
    """The MoE layer's output for this rank's ``tokens`` [T, h] (routing weights ``probs`` and
    choices ``chosen``, [T, E]), its ``experts`` (global index, MLP) this rank's share of the
    E, in order: each (token, expert) copy sent to the expert's owner with its routing weight,
    run there, sent back and summed in expert order, as one process sums them."""
    ep, num_experts = group.size(), chosen.shape[1]
    local = num_experts // ep
    rows = [chosen[:, e].nonzero().squeeze(1) for e in range(num_experts)]  # token order
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=tokens.device)
    # What each rank sends each of my experts: [source, local expert].
    incoming = exchange(counts, group, [local] * ep, [local] * ep).view(ep, local)
    send = counts.view(ep, local).sum(1).tolist()
    receive = incoming.sum(1).tolist()
    order = torch.cat(rows)
    weights = torch.cat([probs[r, e] for e, r in enumerate(rows)])
    x = Exchange.apply(tokens[order], group, send, receive)
    w = Exchange.apply(weights, group, send, receive)
    # Received by source, then expert; each expert runs on its rows of every source, in
    # source order.
    starts = torch.cumsum(incoming.flatten(), 0) - incoming.flatten()
    spans = [
        [(int(starts[s * local + j]), int(incoming[s, j])) for s in range(ep)] for j in range(local)
    ]
    outputs, places = [], []
    for (_, expert), span in zip(experts, spans, strict=True):
        idx = torch.cat([torch.arange(a, a + n, device=tokens.device) for a, n in span])
        outputs.append(expert(x[idx], scale=w[idx]))  # every expert runs, on no rows too
        places.append(idx)
    y = outputs[0].new_zeros((x.shape[0], outputs[0].shape[1]))
    y = y.index_copy(0, torch.cat(places), torch.cat(outputs))
    back = Exchange.apply(y, group, receive, send)
    out = tokens.new_zeros(tokens.shape, dtype=back.dtype)
    for r, part in zip(rows, back.split([len(r) for r in rows]), strict=True):
        out = out.index_add(0, r, part)
    return out
