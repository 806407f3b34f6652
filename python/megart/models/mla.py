"""Multi-latent attention (DeepSeek-V2/V3's MLA, Megatron's --multi-latent-attention) of a GPT
layer, tensor-parallel, with plain rope or YaRN (activations [s, b, h], sequence first)."""

from __future__ import annotations

import math

import torch
from torch import nn

from megart.distributed import ProcessGroup
from megart.models.attention import core_settings, cp_attention
from megart.models.config import GPTConfig
from megart.models.init import generator, weight_init
from megart.models.norms import norm
from megart.models.recompute import checkpointed
from megart.models.rope import apply_rotary
from megart.models.window import sequence_attention
from megart.models.yarn import yarn_mscale
from megart.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    copy_to_region,
    gather_from_region,
    scatter_to_sequence_region,
)
from megart.tensor_parallel._group import group_size
from megart.tensor_parallel.column_entry import WeightGradSlot


class MLA(nn.Module):
    """Causal self-attention whose keys and values come from a small latent, as Megatron-Core's
    MLASelfAttention with its local layer spec computes it:

    - queries: ``q_proj`` (h to heads x (qk_head_dim + qk_pos_emb_head_dim)), or with
      q_lora_rank ``q_down_proj`` (h to q_lora_rank), ``q_layernorm``, ``q_up_proj``;
    - keys and values: ``kv_down_proj`` (h to kv_lora_rank + qk_pos_emb_head_dim), the latent
      part through ``kv_layernorm`` and ``kv_up_proj`` (to heads x (qk_head_dim +
      v_head_dim): each head's key channels, then its value channels); the other
      qk_pos_emb_head_dim channels are one rope key part that every head shares;
    - rope turns only the last qk_pos_emb_head_dim channels of each query head and that shared
      key part, in adjacent pairs (see _rotated); scores are scaled by
      1/sqrt(qk_head_dim + qk_pos_emb_head_dim);
    - with YaRN (rope_type "yarn", Megatron's --rope-type yarn) the rope channels turn by
      YaRN's frequencies, their cos and sin times yarn_concentration (the GPT's rope tables,
      models.rope), and the scores' scale is further multiplied by
      yarn_mscale(factor, mscale_all_dim) squared, over every channel (Megatron-Core's
      softmax_scale; DeepSeek's Hugging Face code multiplies its own the same way);
    - ``proj`` (heads x v_head_dim to h), row-parallel.

    The norms exist with --qk-layernorm only, as in Megatron-Core's specs (Identity without).
    Under tensor parallelism every projection is column-parallel, the heads split across
    ranks; the down-projections' outputs are gathered whole on every rank, as Megatron-Core's
    local spec does (its Transformer Engine spec keeps them replicated instead: the same
    numbers). With sequence parallelism the latents go back to each rank's slice of the
    sequence for their norms, and the up-projections gather them again. The shared rope key
    part is used on every rank for its own heads only: its gradient is a partial sum, summed
    across the group (copy_to_region) before it reaches the down-projection.

    With context parallelism (``cp_group``) each rank projects its own part of each sequence
    (rope at the tokens' global positions, as GPTChunk gives it) and attends by the
    --cp-comm-type's exchange (megart.models.attention's), its keys (the shared rope part
    repeated per head, as Megatron-Core's MLA hands them to its attention) and its values at
    their own widths; the ring pads the values to the keys' width (ring_attention)."""

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
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.cfg, self.rng, self.tp_group, self.sp = cfg, rng, tp_group, sequence_parallel
        self.cp_group = cp_group
        self.local_heads = heads // group_size(tp_group)
        self.q_dim = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
        # None: torch's 1/sqrt(q_dim), what plain rope's Megatron-Core computes.
        self.softmax_scale = None
        if cfg.rope_type == "yarn":
            m = yarn_mscale(cfg.yarn_rotary_scaling_factor, cfg.yarn_mscale_all_dim)
            self.softmax_scale = m * m / math.sqrt(self.q_dim)

        def column(name: str, fan_in: int, rows: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                fan_in,
                rows,
                bias=False,  # none of MLA's projections but the output one has a bias
                sequence_parallel=sequence_parallel,
                tp_group=tp_group,
                init_method=weight_init(cfg, cfg.init_std, (rows, fan_in)),
                generator=generator(cfg.seed, layer, name),
            )

        if cfg.q_lora_rank is None:
            self.q_proj = column("q_proj", h, heads * self.q_dim)
        else:
            self.q_down_proj = column("q_down_proj", h, cfg.q_lora_rank)
            self.q_up_proj = column("q_up_proj", cfg.q_lora_rank, heads * self.q_dim)
        kv_rows = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
        self.kv_down_proj = column("kv_down_proj", h, kv_rows)
        kv_up_rows = heads * (cfg.qk_head_dim + cfg.v_head_dim)
        self.kv_up_proj = column("kv_up_proj", cfg.kv_lora_rank, kv_up_rows)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.proj = RowParallelLinear(
            heads * cfg.v_head_dim,
            h,
            bias=cfg.bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            init_method=weight_init(cfg, out_std, (h, heads * cfg.v_head_dim)),
            generator=generator(cfg.seed, layer, "proj"),
        )
        if cfg.qk_layernorm:
            # Over each token's latent: on a slice of the sequence under sequence
            # parallelism (partial gradients), else on the whole one, alike on every rank.
            if cfg.q_lora_rank is not None:
                self.q_layernorm = norm(cfg, sequence_parallel, cfg.q_lora_rank)
            self.kv_layernorm = norm(cfg, sequence_parallel, cfg.kv_lora_rank)

    @property
    def entry(self) -> ColumnParallelLinear:
        """The column-parallel layer whose ``enter`` takes the input, shared by the query and
        key/value projections that read it (one gather, one saved copy)."""
        return self.kv_down_proj

    def _latent(self, y: torch.Tensor) -> torch.Tensor:
        """A down-projection's output, its rows gathered from the ranks: the whole latent for
        every token [s, b, r]."""
        return gather_from_region(y, self.tp_group)

    def _normed(self, latent: torch.Tensor, name: str) -> torch.Tensor:
        """A latent [s, b, r] (whole sequence) through its norm: on this rank's slice of the
        sequence under sequence parallelism, where the up-projection gathers it again."""
        if self.sp:
            latent = scatter_to_sequence_region(latent, self.tp_group)
        return getattr(self, name)(latent) if self.cfg.qk_layernorm else latent

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        entered: bool = False,
        slot: WeightGradSlot | None = None,
    ) -> torch.Tensor:
        """As Attention.forward: ``rope`` the (cos, sin) of qk_pos_emb_head_dim channels;
        ``entered``: ``x`` and ``slot`` are what ``self.entry.enter`` made of the input."""
        cfg = self.cfg
        if not entered:
            x, slot = self.entry.enter(x)
        if cfg.q_lora_rank is None:
            q = self.q_proj(x, entered=True, slot=slot)
        else:
            q_latent = self._latent(self.q_down_proj(x, entered=True, slot=slot))
            q = self.q_up_proj(self._normed(q_latent, "q_layernorm"))
        kv_latent, k_pos = self._latent(self.kv_down_proj(x, entered=True, slot=slot)).split(
            [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1
        )
        kv = self.kv_up_proj(self._normed(kv_latent, "kv_layernorm"))
        s, b, _ = q.shape
        # [b, heads, s, d] views of this rank's heads.
        q = q.view(s, b, self.local_heads, self.q_dim).permute(1, 2, 0, 3)
        kv = kv.view(s, b, self.local_heads, -1).permute(1, 2, 0, 3)
        k, v = kv.split([cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        q, q_pos = q.split([cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        # [b, 1, s, pos]: one for all heads; its gradient summed over the ranks' heads.
        k_pos = copy_to_region(k_pos, self.tp_group).permute(1, 0, 2).unsqueeze(1)
        if rope is not None:
            q_pos, k_pos = self._rotated(q_pos, rope), self._rotated(k_pos, rope)
        q = torch.cat([q, q_pos], dim=-1)
        k = torch.cat([k, k_pos.expand(-1, self.local_heads, -1, -1)], dim=-1)
        if cfg.recomputes("core_attn") and torch.is_grad_enabled():
            y = checkpointed(self._core, self.rng, q, k, v, mask)
        else:
            y = self._core(q, k, v, mask)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _rotated(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rope on rope channels ``x`` [b, heads, s, pos] as Megatron-Core's MLA turns them:
        it orders them even channels then odd and turns the halves, i.e. adjacent pairs (2i,
        2i+1) by frequency i (DeepSeek's). megart turns those pairs in place: the same scores,
        since queries and keys would share the reordering."""
        return apply_rotary(x, *rope, interleaved=True)

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(qk_head_dim + qk_pos_emb_head_dim)) v (YaRN: the scale times
        its mscale squared), causal (where ``mask`` allows), attention dropout on the
        tensor-parallel stream: what selective recomputation (core_attn) recomputes. Values
        are v_head_dim wide, queries and keys q_dim."""
        dropout, stream, kernel = core_settings(self)
        with stream, kernel:
            # None: torch's default scale, 1/sqrt of q's width (Megatron-Core's softmax_scale
            # without YaRN).
            if group_size(self.cp_group) > 1:
                return cp_attention(q, k, v, self.cp_group, self.cfg.cp_comm_type, dropout,
                                    self.softmax_scale)  # fmt: skip
            return sequence_attention(q, k, v, dropout, None, mask, scale=self.softmax_scale)
