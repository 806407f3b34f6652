"""Self-attention of a GPT layer, tensor-parallel (activations [s, b, h], sequence first)."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from megart.distributed import ProcessGroup
from megart.models.all_to_all_attention import all_to_all_attention
from megart.models.config import GPTConfig
from megart.models.context_parallel import context_attention, gather_kv
from megart.models.init import generator, weight_init
from megart.models.norms import norm
from megart.models.recompute import checkpointed
from megart.models.ring_attention import ring_attention
from megart.models.rope import apply_rotary
from megart.models.sinks import sink_logits
from megart.models.window import covers, sequence_attention
from megart.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
)
from megart.tensor_parallel._group import group_rank, group_size
from megart.tensor_parallel.column_entry import WeightGradSlot


class Attention(nn.Module):
    """Causal self-attention with heads split across tensor parallelism: the fused q/k/v
    projection is column-parallel, the output projection row-parallel. Attention dropout runs
    on the tracker's tensor-parallel stream, distinct per rank, as Megatron's does.

    With grouped-query attention (GPTConfig.num_query_groups) the heads share key and value
    heads in groups of heads/groups. The fused projection's rows are grouped per query group
    as [q of the group's heads, k, v], so a rank's contiguous slice holds whole groups (and
    resharding by contiguous row chunks stays right); with one group per head that is [q, k, v]
    per head, the multi-head layout.

    With context parallelism (``cp_group``) each rank holds part of each sequence: keys and
    values are gathered over the group after rope, and attention is causal by the tokens'
    global positions (megart.models.context_parallel.context_attention).

    With a sliding window (GPTConfig.window_size, on the layers window_attn_skip_freq picks)
    each token attends to itself and the window's earlier tokens only (megart.models.window),
    by global positions under context parallelism, within its document with a documents'
    mask."""

    def __init__(
        self,
        cfg: GPTConfig,
        layer: int,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool,
        rng: RNGStatesTracker | None = None,
        cp_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        h, t = cfg.hidden_size, group_size(tp_group)
        self.cfg, self.rng, self.cp_group = cfg, rng, cp_group
        self.local_heads = cfg.num_attention_heads // t
        self.local_groups = cfg.query_groups // t
        self.window = cfg.layer_window(layer)  # earlier tokens seen; None: all
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        qkv_rows = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim
        self.qkv = ColumnParallelLinear(
            h,
            qkv_rows,
            # Its rows (and so the bias's) grouped per query group like the weight's: a rank's
            # contiguous slice of both holds its whole groups.
            bias=cfg.qkv_bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            init_method=weight_init(cfg, cfg.init_std, (qkv_rows, h)),
            generator=generator(cfg.seed, layer, "qkv"),
        )
        self.proj = RowParallelLinear(
            cfg.query_size,
            h,
            bias=cfg.bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            init_method=weight_init(cfg, out_std, (h, cfg.query_size)),
            generator=generator(cfg.seed, layer, "proj"),
        )
        if cfg.qk_layernorm:
            # Each rank normalises its own heads with the same weights: like a sequence-parallel
            # norm's, their gradients are partial sums across t (Megatron-Core sums them too).
            self.q_layernorm = norm(cfg, True, cfg.head_dim)
            self.k_layernorm = norm(cfg, True, cfg.head_dim)
        # --softmax-type learnable: a logit per rank's head (megart.models.sinks)
        self.softmax_offset = make_sink(cfg, layer, tp_group)

    @property
    def entry(self) -> ColumnParallelLinear:
        """The column-parallel layer whose ``enter`` takes the input (the block's recomputed
        norms enter it there)."""
        return self.qkv

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        entered: bool = False,
        slot: WeightGradSlot | None = None,
    ) -> torch.Tensor:
        """``mask``: [b, 1, s, s] booleans (True: may attend), causal already (documents'
        block-diagonal mask, megart.models.documents); None: causal over the sequence.
        ``entered``: ``x`` and ``slot`` are what ``self.qkv.enter`` made of the input."""
        # [s, b, (heads + 2 groups) d / t]: whole sequence, rank's groups
        qkv = self.qkv(x, entered=entered, slot=slot)
        s, b, _ = qkv.shape
        d, per_group = self.cfg.head_dim, self.local_heads // self.local_groups
        grouped = qkv.view(s, b, self.local_groups, per_group + 2, d)
        q, k, v = grouped.split([per_group, 1, 1], dim=3)
        q, k = q.reshape(s, b, self.local_heads, d), k.squeeze(3)
        if self.cfg.qk_layernorm:  # each head over its channels, before rope
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # [b, heads, s, d] and [b, groups, s, d]: views, with one group per head the very
        # strides the multi-head layout gave.
        q = q.permute(1, 2, 0, 3)
        k, v = k.permute(1, 2, 0, 3), v.squeeze(3).permute(1, 2, 0, 3)
        if rope is not None:
            turn = self.cfg.rotary_interleaved
            q, k = apply_rotary(q, *rope, turn), apply_rotary(k, *rope, turn)
        cp = group_size(self.cp_group)
        where = None  # (cp, cp rank) with context parallelism
        if cp > 1:
            if self.cfg.cp_comm_type == "all_gather":  # else each rank's K/V go round a ring
                k, v = gather_kv(k, self.cp_group), gather_kv(v, self.cp_group)
            where = (cp, group_rank(self.cp_group))
        # A window that reaches back to the sequence's start masks nothing: none, so that the
        # kernels without a mask tensor still apply.
        window = None if covers(self.window, s * cp) else self.window
        if self.cfg.recomputes("core_attn") and torch.is_grad_enabled():
            y = checkpointed(self._core, self.rng, q, k, v, where, mask, window)
        else:
            y = self._core(q, k, v, where, mask, window)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        where: tuple[int, int] | None = None,
        mask: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal (with context parallelism, ``where`` = (cp, cp
        rank), by global positions, within ``window`` earlier tokens; with ``mask``, where it
        allows), with attention dropout on
        the tensor-parallel stream: what selective recomputation recomputes (so it keeps k and v
        per group)."""
        per_group = q.shape[1] // k.shape[1]
        dropout, stream, kernel = core_settings(self)
        sink = sink_logits(self.cfg.softmax_type, self.softmax_offset, q.shape[1], q)
        if where is not None and self.cfg.cp_comm_type != "all_gather":  # the groups' K/V travel
            attend = ring_attention if self.cfg.cp_comm_type == "p2p" else all_to_all_attention
            with stream, kernel:
                return attend(q, k, v, self.cp_group, dropout, window=window, sink=sink)
        if per_group > 1:
            # Each group's key and value head, once per query head of the group (heads are
            # numbered group by group). Explicit rather than sdpa's enable_gqa, so that every
            # attention backend and torch's FLOP counter see plain multi-head attention.
            k = k.repeat_interleave(per_group, dim=1)
            v = v.repeat_interleave(per_group, dim=1)
        with stream, kernel:
            if where is not None:
                return context_attention(q, k, v, *where, dropout, window, sink=sink)
            return sequence_attention(q, k, v, dropout, window, mask, sink=sink)


def core_settings(
    module: nn.Module,
) -> tuple[float, contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """An attention module's (its cfg, rng and training mode) dropout probability, the random
    stream its dropout draws from (the tracker's tensor-parallel one, distinct per rank) and
    the kernel choice its core runs under."""
    dropout = module.cfg.attention_dropout if module.training else 0.0
    stream = module.rng.fork() if dropout and module.rng else contextlib.nullcontext()
    # Megatron's --attention-backend unfused/local: the softmax of the explicit s x s
    # scores (torch's math kernel); otherwise torch picks flash or fused kernels.
    unfused = module.cfg.attention_backend in ("unfused", "local")
    kernel = sdpa_kernel(SDPBackend.MATH) if unfused else contextlib.nullcontext()
    return dropout, stream, kernel


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    comm: str,
    dropout: float,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this context-parallel rank's queries over the whole sequence, by the
    exchange ``comm`` (--cp-comm-type: p2p a ring, a2a all-to-alls, all_gather the keys and
    values gathered), for a layer whose keys and values are one per query head (multi-latent
    attention's; ``scale`` its scores' factor, None: 1/sqrt of the queries' width)."""
    if comm == "p2p":
        return ring_attention(q, k, v, group, dropout, scale=scale)
    if comm == "a2a":
        return all_to_all_attention(q, k, v, group, dropout, scale=scale)
    k, v = gather_kv(k, group), gather_kv(v, group)
    return context_attention(
        q, k, v, group_size(group), group_rank(group), dropout, None, scale=scale
    )


def make_sink(cfg: GPTConfig, layer: int, tp_group: ProcessGroup | None) -> nn.Parameter | None:
    """Layer ``layer``'s learnable attention-sink logits (megart.models.sinks), this rank's
    heads' (None for the other softmax types)."""
    if cfg.softmax_type != "learnable":
        return None
    whole = torch.empty(cfg.num_attention_heads, dtype=torch.float32)
    whole.normal_(0.0, cfg.init_std, generator=generator(cfg.seed, layer, "softmax_offset"))
    param = nn.Parameter(whole.chunk(group_size(tp_group))[group_rank(tp_group)].clone())
    param.partition_dim = 0
    return param
