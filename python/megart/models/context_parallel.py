"""Context parallelism: each sequence split over the ranks of a context-parallel group.

The split is Megatron's load-balanced one for causal attention: the sequence is cut into 2 cp
equal chunks and cp rank r holds chunks r and 2 cp - 1 - r, so that every rank holds as many
early (cheap) as late (costly) query positions. Tokens, targets and positions are split alike;
rope and learned position embeddings use each token's global position.

Attention needs the keys and values of every earlier token. Here they travel the simple, exact
way (Megatron-Core's cp_comm_type "all_gather", --cp-comm-type all_gather): each rank
all-gathers K and V over the group in the forward and reduce-scatters their gradients in the
backward. On a GPU the gathered keys are put back in the sequence's order and each of the
rank's two query chunks attends to the keys up to its own chunk's end, causal aligned to the
lower right (blockwise_attention): no mask is built or kept, flash kernels apply, and every
rank computes 1/cp of the causal scores.
Elsewhere one call scores all keys under the explicit mask of global positions
(masked_attention; the same attention, tested equal to the blockwise one). Under this exchange
every rank holds the whole K and V for the length of one layer's attention; the ring
(--cp-comm-type p2p, the default: megart.models.ring_attention) and the all-to-all (a2a:
megart.models.all_to_all_attention) do not.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megart.distributed import ProcessGroup
from megart.errors import ConfigError
from megart.models.sinks import sink_attention
from megart.models.window_masks import additive_bias, bias_dtype, window_mask
from megart.parallel.layout import nearest_multiples
from megart.tensor_parallel._group import group_rank, group_size
from megart.tensor_parallel.mappings import gather_from_sequence_region


def cp_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2 cp chunks of a sequence that context-parallel rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def check_divisible(seq: int, cp: int, sp_tp: int = 1) -> None:
    """A sequence of ``seq`` tokens splits into 2 cp equal chunks, or a ConfigError says so.
    ``sp_tp``: the tensor-parallel size that sequence parallelism splits each rank's s/cp
    tokens over (1 without), so that the lengths the error names fit that split too."""
    if seq % (2 * cp):
        unit = math.lcm(2 * cp, cp * sp_tp)
        also = ""
        if unit != 2 * cp:
            also = (f" (multiples of {unit}: --sequence-parallel splits each rank's s/cp "
                    f"tokens over tensor-parallel size {sp_tp})")  # fmt: skip
        raise ConfigError(
            f"--seq-length {seq} is not divisible by 2 x --context-parallel-size {cp} = "
            f"{2 * cp} (context parallelism cuts each sequence into 2 cp equal chunks); use "
            f"--seq-length {nearest_multiples(seq, unit)}{also}, or another "
            "--context-parallel-size"
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


def causal_mask(
    cp: int, cp_rank: int, local: int, device: torch.device | None, window: int | None = None
) -> torch.Tensor:
    """[local, local x cp] booleans: query i of ``cp_rank`` may attend to gathered key j (keys in
    group-rank order, each rank's own split) when j's global position is not after i's (and,
    with a sliding ``window``, at most that many before it: megart.models.window)."""
    queries = cp_positions(local * cp, cp, cp_rank, device)
    keys = torch.cat([cp_positions(local * cp, cp, r, device) for r in range(cp)])
    return window_mask(queries, keys, window)


def in_sequence_order(kv: torch.Tensor, cp: int, dim: int = 2) -> torch.Tensor:
    """Gathered keys or values (group-rank order: rank r's chunks r and 2 cp - 1 - r, see
    gather_kv) in the sequence's own order, chunk 0 first."""
    pieces = kv.chunk(2 * cp, dim)  # rank r's two chunks are pieces 2r and 2r + 1
    at = {}
    for r in range(cp):
        first, second = cp_chunks(cp, r)
        at[first], at[second] = pieces[2 * r], pieces[2 * r + 1]
    return torch.cat([at[chunk] for chunk in range(2 * cp)], dim)


def query_blocks(cp: int, cp_rank: int, local: int) -> list[tuple[slice, int]]:
    """For each of ``cp_rank``'s two query chunks (its ``local`` tokens' halves): its rows, and
    how many keys of the sequence (in order, see in_sequence_order) it attends to, those up to
    its chunk's end. Causal attention over them is aligned to the lower right: query i of the
    chunk sees the keys up to its own global position."""
    half = local // 2
    return [
        (slice(i * half, (i + 1) * half), (chunk + 1) * half)
        for i, chunk in enumerate(cp_chunks(cp, cp_rank))
    ]


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: int,
    cp_rank: int,
    dropout: float,
    window: int | None = None,
    *,
    scale: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``cp_rank``'s queries over the keys and values gathered by
    gather_kv (group-rank order). On a GPU blockwise (blockwise_attention: no mask tensor, flash
    kernels, 1/cp of the causal scores); elsewhere, and with a sliding ``window``, one call under
    the explicit mask of global positions (masked_attention: the same attention, and what the
    CPU tests measure). ``scale``: the scores' factor (None: 1/sqrt of the queries' width;
    multi-latent attention's YaRN gives its own); the values may be narrower than the keys.
    With ``sink`` logits (megart.models.sinks), one call under the explicit mask of global
    positions."""
    if sink is not None:
        bias = causal_bias(cp, cp_rank, q.shape[2], window, bias_dtype(q), q.device)
        return sink_attention(q, k, v, sink, dropout, bias)
    if q.is_cuda and window is None:
        return blockwise_attention(q, k, v, cp, cp_rank, dropout, scale)
    return masked_attention(q, k, v, cp, cp_rank, dropout, window, scale)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: int,
    cp_rank: int,
    dropout: float,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """context_attention as one call of torch's attention over all gathered keys, masked by
    global positions (causal_mask, with the sliding ``window`` if any): every (s/cp) x s score
    computed, the mask kept for the backward."""
    bias = causal_bias(cp, cp_rank, q.shape[2], window, bias_dtype(q), q.device)
    return F.scaled_dot_product_attention(q, k, v, bias, dropout_p=dropout, scale=scale)


@functools.lru_cache(maxsize=4)
def causal_bias(
    cp: int, cp_rank: int, local: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """causal_mask as an additive bias in ``dtype``, made once and kept by every call: given
    the boolean mask, torch's attention would make (and its backward keep) a float copy per
    layer and microbatch (megart.models.window_masks). Read-only."""
    return additive_bias(causal_mask(cp, cp_rank, local, device, window), dtype)


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: int,
    cp_rank: int,
    dropout: float,
    scale: float | None = None,
) -> torch.Tensor:
    """context_attention as two calls, one per query chunk, over the keys in the sequence's
    order up to that chunk's end (query_blocks), causal aligned to the lower right: torch's
    causal bias object, which flash kernels apply without a mask tensor (elsewhere torch builds
    the block's mask)."""
    k, v = in_sequence_order(k, cp), in_sequence_order(v, cp)
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, rows],
                k[:, :, :keys],
                v[:, :, :keys],
                attn_mask=causal_lower_right(rows.stop - rows.start, keys),
                dropout_p=dropout,
                scale=scale,
            )
            for rows, keys in query_blocks(cp, cp_rank, q.shape[2])
        ],
        dim=2,
    )


def gather_kv(x: torch.Tensor, group: ProcessGroup | None, dim: int = 2) -> torch.Tensor:
    """Every context-parallel rank's part of ``x`` (keys or values, [b, heads, s, d]) along
    ``dim``, in group-rank order; the identity without context parallelism. The backward
    reduce-scatters (sums) the gradient, since every rank's queries read every rank's keys and
    values: the sequence-parallel all-gather's autograd pair (megart.tensor_parallel), here
    over the context-parallel group."""
    return gather_from_sequence_region(x, group, dim, reduce_grad=True)
