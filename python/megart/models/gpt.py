"""GPT: a stack of pre-norm transformer layers between a vocab-parallel embedding and an
output layer (tied to the embedding, or with its own weight), split into pipeline chunks when
asked.

``GPTChunk`` is one contiguous run of layers, with the embedding when it is the first and the
final norm and output layer when it is the last. ``GPT`` is all of it in one chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megart.distributed import ProcessGroup
from megart.kernels import fused_vocab_parallel_cross_entropy
from megart.models.blocks import Block
from megart.models.config import GPTConfig
from megart.models.context_parallel import group_positions
from megart.models.documents import Documents
from megart.models.init import generator, weight_init
from megart.models.moe import AuxLossScale
from megart.models.mtp import MultiTokenPrediction
from megart.models.norms import HALF, apply_norm, norm
from megart.models.recompute import checkpointed, recomputed_spans
from megart.models.rope import rotary
from megart.models.stages import chunk_layers
from megart.tensor_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    VocabParallelEmbedding,
    gather_from_region,
    vocab_parallel_cross_entropy,
)
from megart.tensor_parallel._group import group_rank, group_size
from megart.tensor_parallel.column_entry import enter_column_region
from megart.tensor_parallel.weight_grad import linear

if TYPE_CHECKING:
    from megart.parallel import ParallelGrid


class GPTChunk(nn.Module):
    """Layers ``layers`` of the model. Input: token ids [b, s] when ``first`` (it holds the
    embedding), else hidden states [s, b, h] ([s/t, b, h] under sequence parallelism). Output:
    this rank's vocabulary slice of the logits, [s, b, V_padded/t], when ``last``, else hidden
    states. With tied embeddings, a last chunk on another rank than the first holds its own copy
    of the embedding, initialised identically; the trainer sums the two gradients.

    With context parallelism (``cp_group``) the tokens and every [s, b, h] are this rank's
    part of each sequence (megart.models.context_parallel's split), and positions are global.

    ``documents`` (megart.models.documents, Megatron's --reset-position-ids and
    --reset-attention-mask): the microbatch's positions within documents, for the learned
    table (first chunk) and rope (every chunk), and its documents' attention mask (every
    chunk)."""

    def __init__(
        self,
        cfg: GPTConfig,
        layers: range,
        first: bool,
        last: bool,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng: RNGStatesTracker | None = None,
        cp_group: ProcessGroup | None = None,
        ep_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.first, self.last, self.rng = cfg, first, last, rng
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.cp_group = cp_group
        self.vocab = cfg.padded_vocab_size(group_size(tp_group))
        untied = cfg.untie_embeddings_and_output_weights
        # Multi-token prediction (models.mtp) on the last stage, with a copy of the embedding.
        mtp = last and bool(cfg.mtp_num_layers)
        # Xavier's fans: the vocabulary padded as at tensor-parallel size 1, so that the
        # draw does not depend on t (megart.models.init).
        vocab_shape = (cfg.padded_vocab_size(1), cfg.hidden_size)
        if first or (last and (not untied or mtp)):
            self.wte = VocabParallelEmbedding(
                self.vocab,
                cfg.hidden_size,
                sequence_parallel=sequence_parallel,
                tp_group=tp_group,
                init_method=weight_init(cfg, cfg.init_std, vocab_shape),
                generator=generator(cfg.seed, "wte"),
            )
            self._unpadded_rows(self.wte.weight)
        if first and cfg.position_embedding == "learned":
            self.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
            draw = weight_init(cfg, cfg.init_std, (cfg.seq_length, cfg.hidden_size))
            draw(self.wpe.weight.data, generator(cfg.seed, "wpe"))
            # Each rank adds the positions of its own sequence slice: a partial gradient.
            self.wpe.weight.sequence_parallel = sequence_parallel
        self.drop = nn.Dropout(cfg.hidden_dropout)
        # Shared by this chunk's MoE layers (models.moe): set by set_loss_scale.
        self.aux_loss_scale = AuxLossScale()
        self.blocks = nn.ModuleList(
            Block(cfg, i, tp_group, sequence_parallel, rng, cp_group, self.aux_loss_scale, ep_group)
            for i in layers
        )
        self.layer_ids = list(layers)
        depth_args = (cfg, (tp_group, ep_group), sequence_parallel, rng, self.aux_loss_scale)
        self.mtp = MultiTokenPrediction(*depth_args, cp_group) if mtp else None
        if last:
            self.ln_f = norm(cfg, sequence_parallel)
        if last and untied:
            # Megatron's output_layer: [V_padded/t, h] of its own, the vocabulary split over t.
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size,
                self.vocab,
                bias=False,
                sequence_parallel=sequence_parallel,
                tp_group=tp_group,
                init_method=weight_init(cfg, cfg.init_std, vocab_shape),
                generator=generator(cfg.seed, "output_layer"),
            )
            self._unpadded_rows(self.output_layer.weight)

    def _blocks(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        if cfg.recompute_granularity != "full" or not torch.is_grad_enabled():
            for block in self.blocks:
                x = block(x, rope, mask)
            return x
        spans = recomputed_spans(len(self.blocks), cfg.recompute_method, cfg.recompute_num_layers)
        for start, stop, recompute in spans:

            def run(h: torch.Tensor, start: int = start, stop: int = stop) -> torch.Tensor:
                for block in self.blocks[start:stop]:
                    h = block(h, rope, mask)
                return h

            x = checkpointed(run, self.rng, x) if recompute else run(x)
        return x

    def set_loss_scale(self, scale: float) -> None:
        """The factor on this run's loss gradients (loss scale / microbatches; the pipeline
        engine sets it), which the MoE layers' auxiliary losses' gradients take too."""
        self.aux_loss_scale.value = scale

    def set_microbatch(self, mb: int) -> None:
        """The microbatch the next forward or backward runs (the pipeline engine sets it before
        each): the key of the MoE routers' noise (models.router_noise), so that recomputation
        in a backward draws its forward's noise."""
        self.aux_loss_scale.noise.microbatch = mb
        if self.mtp is not None:
            self.mtp.microbatch = mb

    def _unpadded_rows(self, weight: torch.Tensor) -> None:
        """Zeroes the rows of padded vocabulary entries, so the weights do not depend on t."""
        start = group_rank(self.tp_group) * weight.shape[0]
        with torch.no_grad():
            weight[max(0, self.cfg.vocab_size - start) :].zero_()

    def _sequence_slice(self, seq: int) -> slice:
        t = group_size(self.tp_group) if self.sequence_parallel else 1
        r = group_rank(self.tp_group) if self.sequence_parallel else 0
        return slice(r * seq // t, (r + 1) * seq // t)

    def forward(self, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        cp = group_size(self.cp_group)
        positions = None if documents is None else documents.positions  # [b, s] or None
        tokens = x if self.first else None
        if self.first and (seq := x.shape[1] * cp) > self.cfg.seq_length:
            raise ValueError(
                f"sequence of {seq} tokens; the model takes at most {self.cfg.seq_length}"
            )
        x = self._embed(x, positions) if self.first else self._residual_stream(x)
        rope = None
        if self.cfg.position_embedding == "rotary":
            t = group_size(self.tp_group) if self.sequence_parallel else 1
            scale = self.cfg.rope_scaling_factor if self.cfg.rope_scaling else None
            rope = rotary(
                x.shape[0] * t * cp,
                self.cfg.rotary_dim,
                x.device,
                self.cfg.rotary_base,
                scale,
                self.cfg.rotary_seq_len_interpolation_factor,
                self.cfg if self.cfg.rope_type == "yarn" else None,
            )
            if positions is not None:  # each sample's own angles: [b, 1, s, d/2]
                rope = (rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1))
            elif cp > 1:  # the angles of this rank's tokens' global positions: the s/cp
                # that attention sees, gathered over t under sequence parallelism
                rows = group_positions(self.cp_group, x.shape[0] * t, x.device)
                rope = (rope[0][rows], rope[1][rows])
        mask = None if documents is None else documents.attention_mask()
        x = self._blocks(x, rope, mask)
        if not self.last:
            return x
        x = apply_norm(self.ln_f, x, self.cfg.fused_layer_norm)
        ids = None if self.mtp is None else self.mtp.first_ids(tokens)
        if ids is not None:  # the depths' outputs after the main one's: one output product
            x = torch.cat([x, *self.mtp.hidden(self._embed, x, ids, positions, rope, mask)])
        if self.cfg.untie_embeddings_and_output_weights:
            # Gathers the sequence (or marks the copy for backward's all-reduce) itself.
            return self._mask_padding(self.output_layer(x))  # [s, b, V_padded / t]
        x, slot = enter_column_region(x, self.tp_group, self.sequence_parallel)
        # Fused like the other linear layers, but never deferred to a zero-bubble W (its dY, the
        # logits' gradient, would be held until then). In a chunk that also looks tokens up in
        # wte, that lookup's accumulation runs wte's hooks, once per backward as unfused.
        hooks = not self.first and ids is None  # no lookup of wte here to run them
        logits = linear(x, self.wte.weight, defer=False, run_hooks=hooks, slot=slot)
        return self._mask_padding(logits)

    def _embed(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Tokens [b, s] embedded (with their positions [b, s], None for 0..s-1), dropped out:
        [s, b, h], this rank's slice of s under sequence parallelism."""
        cp = group_size(self.cp_group)
        h = self.wte(x.t())
        if self.cfg.position_embedding == "learned":
            rows = self._sequence_slice(x.shape[1])
            if positions is not None:  # each sample's own rows: [s, b, h]
                h = h + self.wpe.weight[positions.t()[rows]]
            else:
                table = self.wpe.weight[: x.shape[1] * cp]
                if cp > 1:  # the rows of this rank's tokens' global positions
                    table = self.wpe.weight[group_positions(self.cp_group, x.shape[1], h.device)]
                h = h + table[rows].unsqueeze(1)
        return self.drop(self._residual_stream(h))

    def _residual_stream(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the residual stream's dtype: autocast's 16-bit type under autocast (as in
        Megatron-LM); fp32 with cfg.fp32_residual_connection, which Megatron-LM's embedding
        casts to as well (--half-weights' 16-bit embedding looks up 16-bit rows); otherwise
        unchanged."""
        if self.cfg.fp32_residual_connection:
            return x.float() if x.dtype in HALF else x
        kind = x.device.type
        if not torch.is_autocast_enabled(kind):
            return x
        return x.to(torch.get_autocast_dtype(kind))

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        per_rank = logits.shape[-1]
        start = group_rank(self.tp_group) * per_rank
        if start + per_rank <= self.cfg.vocab_size:
            return logits
        padded = torch.arange(start, start + per_rank, device=logits.device) >= self.cfg.vocab_size
        return logits.masked_fill(padded, float("-inf"))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy from this rank's logits slice and targets [b, s]."""
        return self.token_losses(logits, targets).mean()

    def token_losses(
        self, logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each token's next-token cross-entropy, [s, b], from this rank's logits slice and
        targets [b, s]; with multi-token prediction's logits after the main ones, the depths'
        losses (under ``loss_mask`` [b, s], None: none) seeded into the backward (models.mtp)."""
        if self.cfg.cross_entropy_loss_fusion:
            ce = fused_vocab_parallel_cross_entropy
        else:
            ce = vocab_parallel_cross_entropy
        if self.mtp is None or logits.shape[0] == targets.shape[1]:
            return ce(logits, targets.t(), self.tp_group)
        return self.mtp.token_losses(ce, logits, targets, loss_mask, self.sequence_parallel)


class GPT(nn.Module):
    """The whole model on every pipeline stage (tensor parallelism only).

    ``model(tokens)`` returns full-vocabulary logits [b, s, V] on every tensor-parallel rank
    (gathered: for inference and tests); ``model(tokens, targets)`` returns the mean
    next-token cross-entropy, computed vocab-parallel (``documents``: see GPTChunk). The
    tensor-parallel group comes from ``grid`` (a megart.ParallelGrid) or ``tp_group``; neither
    means one process. ``ep_group``: the expert-parallel group the MoE layers' experts are
    spread over (``grid``'s where given).
    """

    def __init__(
        self,
        cfg: GPTConfig,
        grid: ParallelGrid | None = None,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        rng: RNGStatesTracker | None = None,
        ep_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if grid is not None:
            tp_group, ep_group = grid.tp_group, grid.ep_group
        cfg.check_layout(tp=group_size(tp_group))
        self.cfg = cfg
        self.chunk = GPTChunk(
            cfg,
            range(cfg.num_layers),
            True,
            True,
            tp_group,
            sequence_parallel,
            rng,
            ep_group=ep_group,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        logits = self.chunk(tokens, documents)
        if targets is not None:
            return self.chunk.loss(logits, targets)
        logits = logits[: tokens.shape[1]]  # the main model's (not multi-token prediction's)
        full = gather_from_region(logits, self.chunk.tp_group)[..., : self.cfg.vocab_size]
        return full.transpose(0, 1)

    @classmethod
    def from_hf(
        cls,
        path: str,
        grid: ParallelGrid | None = None,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        expect: str | None = None,
    ) -> GPT:
        """Loads a GPT-2 or Llama directory written by transformers' ``save_pretrained``
        (config.json and .safetensors files; local files only) into this tensor-parallel
        layout; config.json's model_type says which (``expect``: "gpt2" or "llama" refuses
        the other)."""
        from megart.models.hf import load_hf

        tp_group = grid.tp_group if grid is not None else tp_group
        return load_hf(cls, path, tp_group, sequence_parallel, expect)

    def save_hf(
        self,
        path: str,
        expect: str | None = None,
        dtype: str = "float32",
        max_shard_size: str = "5GB",
    ) -> None:
        """Writes a directory that transformers' ``from_pretrained`` loads: GPT-2's format
        (GPT2LMHeadModel) for GPT-2's architecture, Llama's (LlamaForCausalLM) for RMSNorm,
        rotary positions and SwiGLU. Written on tensor-parallel rank 0; every rank must call
        it, since the shards are gathered. ``expect``: "gpt2" or "llama" insists on one;
        ``dtype``: float32, bfloat16 or float16; ``max_shard_size``: the largest weight file
        (transformers' spelling, e.g. 5GB), beyond which files are numbered with an index."""
        from megart.models.hf import save_hf

        save_hf(self, path, expect, dtype, max_shard_size)

    @classmethod
    def from_hf_gpt2(cls, path: str, **kw: Any) -> GPT:
        """``from_hf`` of a GPT-2 directory only."""
        return cls.from_hf(path, **kw, expect="gpt2")

    def save_hf_gpt2(self, path: str) -> None:
        """``save_hf`` in GPT-2's format only (``GPT2LMHeadModel.from_pretrained`` loads it)."""
        self.save_hf(path, expect="gpt2")


def pipeline_chunks(
    cfg: GPTConfig,
    pp_rank: int,
    pp: int,
    chunks: int = 1,
    tp_group: ProcessGroup | None = None,
    sequence_parallel: bool = False,
    rng: RNGStatesTracker | None = None,
    v_shape: bool = False,
    first: int | None = None,
    last: int | None = None,
    cp_group: ProcessGroup | None = None,
    ep_group: ProcessGroup | None = None,
) -> list[GPTChunk]:
    """This pipeline rank's model chunks (see chunk_layers; ``first``/``last``: the layers of
    uneven first/last stages; ``cp_group``: context parallelism's, ``ep_group`` expert
    parallelism's: models.moe); the first virtual stage
    holds the embedding, the last the final norm and output layer."""
    cfg.check_layout(tp=group_size(tp_group), pp=pp, chunks=chunks, first=first, last=last)
    return [
        GPTChunk(
            cfg,
            layers,
            layers.start == 0,
            layers.stop == cfg.num_layers,
            tp_group,
            sequence_parallel,
            rng,
            cp_group,
            ep_group,
        )
        for layers in chunk_layers(cfg.num_layers, pp_rank, pp, chunks, v_shape, first, last)
    ]
