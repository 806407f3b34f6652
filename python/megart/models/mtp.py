"""Multi-token prediction (DeepSeek-V3's MTP, as Megatron-Core 0.16.1 builds it with
--mtp-num-layers D and --mtp-loss-scaling-factor): D sequential depths on the last pipeline
stage, after the final norm. Depth k (1-based) takes the previous depth's hidden states h (the
main model's normed output for k = 1) and the embedding e of the input tokens shifted left by
k (the shared word embedding, with the learned positions shifted alike), and computes

    final_layernorm(layer(eh_proj(cat(enorm(e), hnorm(h)))))

(the embedding's half first, as Megatron-Core concatenates), eh_proj a column-parallel 2h -> h
projection without bias whose output is gathered over tensor parallelism (then split over the
sequence again under sequence parallelism), layer one transformer layer (Megatron's layer
number num_layers + k) of the last decoder layer's kind, as Megatron-Core builds it from that
layer's spec: with --num-experts an MoE layer where that one is (whatever --moe-layer-freq
would say of its own number), its experts spread over the expert-parallel group with the
decoder's, its auxiliary losses seeded as the decoder's are (at the training loss's factor,
not the depths' below) and logged among theirs. The shared output layer turns each depth's
output into logits; depth k's loss is the cross-entropy against the labels shifted left by k,
its loss mask shifted alike (what shifted off the end is zero: masked out), divided by the
mask's count. The depths' losses times --mtp-loss-scaling-factor / D are added to the
training loss through the gradient only (Megatron-Core's MTPLossAutoScaler, megart's
models.moe seeding), so the loss reported is the main model's; each depth's loss is logged as
"mtp_k loss" (training.mtp_metrics).

A last stage that is not the first gets the tokens from the labels (the labels are the tokens
shifted left by one): the trainer hands this rank's microbatches' labels over (``feed``) before
the schedule runs, and the pipeline engine names the microbatch each forward runs.

Under context parallelism every shift is along the whole sequence, not within a rank's chunks
(models.mtp_sequence: Megatron-Core's roll over its cp group), and each depth's loss is the
mean over the whole sequence's mask: each rank divides its part's sum by the sequence's count
over cp, so that the average over the cp ranks (the gradients', and the logged losses') is the
one-process loss. Megatron-Core 0.16.1 divides by each rank's own count instead, which differs
from its own one-process loss wherever the ranks' counts differ (always: the last k positions,
masked for depth k, are all on cp rank 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from megart.distributed import ProcessGroup
from megart.models.blocks import Block
from megart.models.init import generator, weight_init
from megart.models.moe import AuxLossScale, _SeedGradient
from megart.models.mtp_sequence import SequenceParts, shift_left
from megart.models.norms import apply_norm, norm
from megart.models.recompute import checkpointed
from megart.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    gather_from_region,
    scatter_to_sequence_region,
)
from megart.tensor_parallel._group import group_size

if TYPE_CHECKING:
    from megart.models.config import GPTConfig


class MTPLayer(nn.Module):
    """One depth (Megatron-Core's MultiTokenPredictionLayer; its parameter names)."""

    def __init__(
        self,
        cfg: GPTConfig,
        depth: int,
        groups: tuple[ProcessGroup | None, ProcessGroup | None],
        sequence_parallel: bool,
        rng: RNGStatesTracker | None,
        loss_scale: AuxLossScale,
        cp_group: ProcessGroup | None = None,
    ) -> None:
        """``groups``: the tensor-parallel group and the expert-parallel one (an MoE layer's
        experts spread over it); ``cp_group``: context parallelism's (the layer's attention
        over the whole sequence, as the decoder's)."""
        super().__init__()
        h = cfg.hidden_size
        tp_group, ep_group = groups
        self.cfg, self.tp_group, self.sequence_parallel, self.rng = (
            cfg,
            tp_group,
            sequence_parallel,
            rng,
        )
        self.enorm = norm(cfg, sequence_parallel)
        self.hnorm = norm(cfg, sequence_parallel)
        self.eh_proj = ColumnParallelLinear(
            2 * h,
            h,
            bias=False,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            init_method=weight_init(cfg, cfg.init_std, (h, 2 * h)),
            generator=generator(cfg.seed, "mtp", depth, "eh_proj"),
        )
        # Megatron-Core numbers the depth's layer after the decoder's and gives it the last
        # decoder layer's spec: an MoE layer where that one is (GPTConfig.is_moe_layer).
        layer = cfg.num_layers + depth
        self.transformer_layer = Block(
            cfg, layer, tp_group, sequence_parallel, rng, cp_group, loss_scale, ep_group
        )
        self.final_layernorm = norm(cfg, sequence_parallel)

    def forward(
        self,
        h: torch.Tensor,
        e: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        cfg = self.cfg
        # Megatron-Core recomputes a depth whole under full uniform recomputation (none under
        # block); selective recomputation is the layer's own.
        if cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform":
            if torch.is_grad_enabled():
                return checkpointed(lambda a, b: self._run(a, b, rope, mask), self.rng, h, e)
        return self._run(h, e, rope, mask)

    def _run(
        self,
        h: torch.Tensor,
        e: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        fused = self.cfg.fused_layer_norm
        x = torch.cat((apply_norm(self.enorm, e, fused), apply_norm(self.hnorm, h, fused)), -1)
        x = gather_from_region(self.eh_proj(x), self.tp_group)  # [s, b, h], every rank's
        if self.sequence_parallel:
            x = scatter_to_sequence_region(x, self.tp_group)
        x = self.transformer_layer(x, rope, mask)
        return apply_norm(self.final_layernorm, x, fused)


class MultiTokenPrediction(nn.Module):
    """The D depths (Megatron-Core's MultiTokenPredictionBlock: ``mtp.layers.K``) and what the
    last stage needs to run them: the tokens (``feed``) and the loss's factor (the chunk's)."""

    def __init__(
        self,
        cfg: GPTConfig,
        groups: tuple[ProcessGroup | None, ProcessGroup | None],
        sequence_parallel: bool,
        rng: RNGStatesTracker | None,
        loss_scale: AuxLossScale,
        cp_group: ProcessGroup | None = None,
    ) -> None:
        """``groups``: the tensor-parallel group and the expert-parallel one (MTPLayer's);
        ``cp_group``: context parallelism's, along whose whole sequence the depths shift."""
        super().__init__()
        self.cfg, self.loss_scale, self.seq = cfg, loss_scale, SequenceParts(cp_group)
        self.tp_group, self.sequence_parallel = groups[0], sequence_parallel
        depths = cfg.mtp_num_layers or 0
        self.layers = nn.ModuleList(
            MTPLayer(cfg, k, groups, sequence_parallel, rng, loss_scale, cp_group)
            for k in range(depths)
        )
        self.labels: list[torch.Tensor] | None = None  # this rank's microbatches' (feed)
        self.microbatch = 0

    def feed(self, labels: list[torch.Tensor] | None) -> None:
        """The labels [b, s] of the microbatches the next schedule runs (None: none; the
        depths then run only where the chunk holds the tokens)."""
        self.labels = labels

    def first_ids(self, tokens: torch.Tensor | None) -> torch.Tensor | None:
        """The depth-1 input ids [b, s] of the whole sequence (every context-parallel rank's
        part): the tokens shifted left by one, from the tokens where the chunk has them, else
        from the fed labels (the same but for the last, zeroed as a shift fills it); None when
        neither is known (inference on a later stage), or without gradients (evaluation: its
        loss is the main model's, the depths' a training signal)."""
        if not torch.is_grad_enabled():
            return None
        if tokens is not None:
            return shift_left(self.seq.whole(tokens))
        if self.labels is None:
            return None
        ids = self.seq.whole(self.labels[self.microbatch]).clone()
        ids[..., -1] = 0
        return ids

    def hidden(
        self,
        embed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        h: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """Each depth's output [s, b, h] (this rank's slice under sequence parallelism) from the
        main model's normed output ``h``; ``ids``: first_ids' (the whole sequence);
        ``embed(ids, positions)`` is the chunk's embedding of this rank's part (``positions``:
        each of its tokens' [b, s], None for the sequence's 0..s-1)."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        else:
            positions = self.seq.whole(positions)
        outs = []
        for k, layer in enumerate(self.layers):
            positions = shift_left(positions)
            if k:
                ids = shift_left(ids)
            h = layer(h, embed(self.seq.part(ids), self.seq.part(positions)), rope, mask)
            outs.append(h)
        return outs

    def token_losses(
        self,
        ce: Callable[..., torch.Tensor],
        logits: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        sequence_parallel: bool,
    ) -> torch.Tensor:
        """The main model's token losses [s, b] (by ``ce``, the chunk's vocab-parallel
        cross-entropy) from the logits of the main model and the depths, [(1 + D) s, b, V/t]
        (the output layer's of the concatenated hidden states), the depths' losses seeded into
        the backward (attach)."""
        t = group_size(self.tp_group) if sequence_parallel else 1
        losses = self.depth_major(ce(logits, self.labels_of(labels, t), self.tp_group), t)
        return self.attach(losses[0], losses[1:], loss_mask)

    def labels_of(self, labels: torch.Tensor, t: int) -> torch.Tensor:
        """The targets [(1 + D) s, b] of the logits the chunk computes with the depths: the
        labels, then each depth's (shifted left by its depth), in the order the output layer
        sees the concatenated hidden states: rank-major under sequence parallelism over ``t``
        ranks (each rank's slice of every depth, gathered)."""
        parts = [labels, *self.seq.shifts(labels, len(self.layers))]
        whole = torch.stack(parts).transpose(1, 2).flatten(0, 1)  # [(1 + D) s, b]
        return _swap(whole, len(parts), t)

    def depth_major(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """``x`` [(1 + D) s, b] in labels_of's order as [1 + D, s, b], depth by depth."""
        d = len(self.layers) + 1
        return _swap(x, t, d).reshape(d, x.shape[0] // d, *x.shape[1:])

    def attach(
        self, main: torch.Tensor, depths: torch.Tensor, loss_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """``main`` [s, b] (the main model's token losses) with each depth's loss (``depths``
        [D, s, b]: its token losses) seeded into the backward at factor
        mtp_loss_scaling_factor / D: the mean over its loss mask (``loss_mask`` [b, s], None:
        every token), shifted left by the depth; under context parallelism this rank's part of
        its sum over the sequence's count / cp (see the module's docstring)."""
        wide = depths.to(torch.promote_types(depths.dtype, torch.float32))
        mask = torch.ones_like(main.t()) if loss_mask is None else loss_mask
        mask = self.seq.whole(mask.to(wide.dtype))  # [b, s], the whole sequence
        factor = self.cfg.mtp_loss_scaling_factor / len(self.layers)
        for k in range(len(self.layers)):
            mask = shift_left(mask)
            loss = (wide[k] * self.seq.part(mask).t()).sum() / self.seq.count_share(mask)
            main = _SeedGradient.apply(main, loss, self.loss_scale, factor, "mtp", 1.0, k)
        return main


def _swap(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """``x`` [a b n, ...], taken as [a, b, n, ...], reordered as [b, a, n, ...] (flat again)."""
    if a == 1 or b == 1:
        return x
    n = x.shape[0] // (a * b)
    return x.reshape(a, b, n, *x.shape[1:]).transpose(0, 1).reshape(x.shape)
