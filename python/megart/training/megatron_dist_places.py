"""Where each of a megart rank's parameters lies in Megatron-LM's torch_dist store
(megart.training.megatron_dist): its key, the offsets of its slice in that key's global tensor
(its layer and expert first where the key has those dimensions:
megart.training.megatron_dist_keys), and whether this rank writes it.

Megatron-Core's sharded keys hold each tensor once, whole, whatever the layout: a
tensor-parallel slice lies at its rank's rows (column-parallel, the vocabulary) or columns
(row-parallel); SwiGLU's gate and up projections are the first and second halves of
``linear_fc1`` (Megatron-Core's swiglu sharded factory: gate slice r at chunk r, up slice r at
chunk t + r); q/k/v are grouped per query group, so a rank's slice is contiguous. A tensor every
tensor-parallel rank holds whole (norms, row-parallel biases) is written by tensor-parallel rank
0 alone, and the last stage's copy of a tied embedding by none (Megatron-Core makes it a replica
of ``embedding.word_embeddings.weight``): each rank loads it from that key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megart.models.megatron_names import EXPERT_BIAS, NAMES
from megart.models.moe_router import biased_routers
from megart.training.megatron_dist_keys import layer_key, mtp_place, stored_place
from megart.training.shards import whole_name

VOCAB_KEYS = (NAMES["wte.weight"], NAMES["output_layer.weight"])


@dataclass
class Place:
    """One parameter's slice in the store."""

    param: torch.Tensor  # a parameter, or a router's expert bias (bias_places)
    key: str
    offsets: list[int]  # in the stored tensor (its layer and expert first, where it has them)
    size: torch.Size  # the stored tensor's, as this run's layout writes it
    owner: bool  # whether this rank writes it (False: a replica another rank writes)

    def piece(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the parameter's shape) shaped as its chunk of the store."""
        return tensor[(None,) * (len(self.offsets) - tensor.dim())]  # a view: loads fill it


def places(chunks: list[Any], tp_rank: int, tp: int) -> list[Place]:
    """The place of every parameter of this rank's model chunks (megart's GPT chunks of
    tensor-parallel rank ``tp_rank`` of ``tp``)."""
    cfg = chunks[0].cfg
    out = []
    for chunk in chunks:
        for key, p in chunk.named_parameters():
            name = whole_name(key, chunk.layer_ids).removeprefix("chunk.")
            # The last stage's copy of the tied embedding (its own ``wte``): read, not written.
            copy = name == "wte.weight" and not chunk.first
            store_key, leading, half = stored_place(name, cfg)
            dim = getattr(p, "partition_dim", None)
            offsets, size = [0] * p.dim(), list(p.shape)
            if dim is not None:
                offsets[dim] = tp_rank * p.shape[dim]
                size[dim] *= tp
                if half is not None:  # [gate; up] in one tensor, split on its rows
                    offsets[0] += half * size[0]
                    size[0] *= 2
            offsets = [i for i, _ in leading] + offsets  # its layer, its expert
            size = [n for _, n in leading] + size
            owner = not copy and (dim is not None or tp_rank == 0)
            out.append(Place(p, store_key, offsets, torch.Size(size), owner))
    return out


def bias_places(chunks: list[Any], tp_rank: int) -> list[Place]:
    """The place of every router's expert bias of this rank's chunks (not a parameter: a
    buffer Megatron-Core's TopKRouter keeps in its state, fp32, under its layer's key
    ``mlp.router.expert_bias``), written by tensor-parallel rank 0 (every rank holds it whole)."""
    cfg = chunks[0].cfg
    out = []
    for router in biased_routers(chunks):
        depth = router.layer - cfg.num_layers  # a depth's (models.mtp): keyed apart
        if depth >= 0:
            key, leading = mtp_place(f"mtp.layers.{depth}.transformer_layer.{EXPERT_BIAS}", cfg)
        else:
            key, leading = layer_key(router.layer, EXPERT_BIAS, cfg)
        offsets = [i for i, _ in leading] + [0]
        size = torch.Size([n for _, n in leading] + [cfg.num_experts])
        out.append(Place(router.expert_bias, key, offsets, size, tp_rank == 0))
    return out
