"""--load of the distributed optimizer's torch_dist store (megart.training.megatron_dist_distopt)
into another tensor/pipeline layout, which Megatron-LM refuses for its dp_reshardable layout.

The saved layout's buffers are a function of the saved flags and the model, so megart can say
where every element of every parameter lies in the store: it numbers the elements of the
one-chunk model (the vocabulary unpadded), lays those numbers out as the saved ranks held them
(megart.training.megatron_layout.split: Megatron-Core's tensor-parallel slices, SwiGLU's
[gate_r; up_r], the tied copy on the last stage; then each chunk's buckets as
megart.training.megatron_distrib_optim lays them out) and records, per element, its bucket
tensor and offset. This rank's parameters, numbered the same way through megart's own slicing,
then read runs of consecutive elements, each run checked to be stored exactly once. The index
costs 12 bytes per parameter of the model while it loads.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models import GPT
from megart.models.megatron_names import to_megatron
from megart.training import dist_store
from megart.training import megatron_dist_chain as chain
from megart.training import megatron_dist_distopt as distopt
from megart.training.megatron_args import saved_stages
from megart.training.megatron_distrib_optim import dp_cp_size, dtype_key, layouts
from megart.training.megatron_layout import OUTPUT, WORD, split
from megart.training.megatron_optimizer import in_megatron_order, is_parameter
from megart.training.shards import whole_name

VOCAB = ("wte.weight", "output_layer.weight")


def _numbered(cfg: Any) -> tuple[dict[str, torch.Tensor], int]:
    """Each parameter of the one-chunk GPT (megart's names), its elements numbered over the
    whole model; the vocabulary's rows unpadded."""
    with torch.device("meta"):
        model = GPT(cfg)
    out, base = {}, 0
    for name, p in model.chunk.named_parameters():
        shape = [cfg.vocab_size, *p.shape[1:]] if name in VOCAB else list(p.shape)
        n = math.prod(shape)
        out[name] = torch.arange(base, base + n).view(shape)
        base += n
    return out, base


def _pad(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary's padding rows: no element of the model (-1)."""
    extra = ids.new_full((rows - ids.shape[0], *ids.shape[1:]), -1)
    return torch.cat([ids, extra]) if rows > ids.shape[0] else ids[:rows]


# A Megatron-Core routed expert's tensor, its global number (the one-chunk model's names).
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def saved_ep(args: dict[str, Any], cfg: Any) -> int:
    """The expert-parallel size a store was saved at (1 for a model without experts)."""
    return int(args.get("expert_model_parallel_size") or 1) if cfg.num_experts else 1


def _saved_parts(
    chunks: list[dict[str, torch.Tensor]],
    t: int,
    s: int,
    tp: int,
    ep: int,
    args: dict[str, Any],
    num_experts: int,
) -> list[tuple[str, list[dict[str, torch.Tensor]], int | None, int | None]]:
    """(keys' prefix, its chunks, the rank's parameters' elements, the ranks it shards over) of
    each DistributedOptimizer of the saved ranks at tensor rank ``t``, stage ``s``: one, or under
    expert parallelism the chain's dense part and each expert-parallel rank's experts (Megatron-
    Core leaves out a chunk without any from the experts' buffers)."""
    if ep == 1:
        return [(distopt.group_prefix(t, s, tp), chunks, None, None)]

    def owner(name: str) -> int | None:
        match = _EXPERT.search(name)
        return None if match is None else int(match.group(1)) // (num_experts // ep)

    dense = [{n: v for n, v in c.items() if owner(n) is None} for c in chunks]
    out = [(chain.CHAIN[0] + distopt.group_prefix(t, s, tp), dense, None, None)]
    dp_cp = dp_cp_size(args)
    for e in range(ep):
        mine = [{n: v for n, v in c.items() if owner(n) == e} for c in chunks]
        total = sum(v.numel() for c in [*dense, *mine] for n, v in c.items() if is_parameter(n, v))
        prefix = chain.expert_prefix(t, s, e, tp, ep)
        out.append((prefix, [c for c in mine if c], total, dp_cp // ep))
    return out


class Index:
    """Where each numbered element lies in the store of the saved layout ``args``."""

    def __init__(self, cfg: Any, args: dict[str, Any]) -> None:
        self.ids, total = _numbered(cfg)
        tp, pp, vpp = distopt.saved_layout(args)
        whole = to_megatron(self.ids, cfg)
        for name in (WORD, OUTPUT):
            if name in whole:
                whole[name] = _pad(whole[name], cfg.padded_vocab_size(tp))
        self.keys: list[str] = []
        self.key = torch.full((total,), -1, dtype=torch.int32)
        self.offset = torch.zeros(total, dtype=torch.int64)
        self.buckets: dict[str, list] = {}  # group prefix -> per_bucket_numel_unpadded
        dtype = dtype_key(args)
        ranks = split(whole, cfg, tp, pp, vpp, **saved_stages(args))
        ep = saved_ep(args, cfg)
        # The chain's first part (its param groups and step are the run's): read_groups's.
        self.first = (chain.CHAIN[0] if ep > 1 else "") + distopt.group_prefix(0, 0, tp)
        for (t, s), rank_chunks in ranks.items():
            rank_chunks = [
                in_megatron_order({n: v for n, v in c.items() if v is not None})
                for c in rank_chunks
            ]
            for prefix, chunks, total, shard in _saved_parts(
                rank_chunks, t, s, tp, ep, args, cfg.num_experts
            ):
                laid = layouts(chunks, args, s, total, shard)
                self.buckets[prefix] = [{dtype: list(layout.buckets)} for layout in laid]
                for g, layout in enumerate(laid):
                    for name, (a, b) in layout.ranges.items():
                        k, offset = layout.locate(a)
                        self.keys.append(distopt.bucket_key(prefix, g, dtype, k))
                        ids = chunks[g][name].reshape(-1)
                        held = ids >= 0
                        self.key[ids[held]] = len(self.keys) - 1
                        self.offset[ids[held]] = offset + torch.arange(b - a)[held]

    def runs(self, ids: torch.Tensor) -> list[tuple[str, int, int, int]]:
        """(bucket key prefix, offset, start, end) of each run of ``ids`` (a parameter's
        numbered elements, -1 for padding) stored consecutively: elements [start, end) lie at
        [offset, offset + end - start) of that bucket's tensors."""
        held = ids >= 0
        key = torch.where(held, self.key[ids.clamp(min=0)], -2)
        if (key == -1).any():
            raise ConfigError(
                "an element of this model has no place in the saved layout's buffers (another "
                "model than the store's?); resume with its model's flags or add --no-load-optim"
            )
        offset = self.offset[ids.clamp(min=0)]
        cut = torch.ones(len(ids), dtype=torch.bool)
        cut[1:] = (key[1:] != key[:-1]) | (offset[1:] != offset[:-1] + 1)
        starts = cut.nonzero().flatten().tolist()
        out = []
        for a, b in zip(starts, [*starts[1:], len(ids)], strict=True):
            if key[a] >= 0:
                out.append((self.keys[int(key[a])], int(offset[a]), a, b))
        return out


def local_ids(index: Index, chunk: Any, name: str, p: Any, tp: int, tp_rank: int) -> torch.Tensor:
    """The numbers of the elements of ``p`` (parameter ``name`` of megart's ``chunk``, sliced
    as megart's tensor-parallel layers slice it), flattened."""
    whole = index.ids[whole_name(name, chunk.layer_ids).removeprefix("chunk.")]
    dim = getattr(p, "partition_dim", None)
    if dim is None:
        return whole.reshape(-1)
    if whole.shape[0] == chunk.cfg.vocab_size and name.removeprefix("chunk.") in VOCAB:
        whole = _pad(whole, p.shape[0] * tp)
    return whole.chunk(tp, dim)[tp_rank].reshape(-1)


def read_resharded(
    root: Path, meta: dict[str, Any], args: dict[str, Any], grid: Any, tp: int, chunks: list[Any]
) -> tuple[list[tuple[Any, dict[str, torch.Tensor]]], float, list[dict[str, Any]], Any]:
    """distopt.read_state for a store of another tensor/pipeline layout."""
    from megart.training.megatron_dist import load_store

    index = Index(chunks[0].cfg, args)
    for prefix, buckets in index.buckets.items():
        distopt.check_buckets(root, prefix, buckets, meta)
    wanted: dict[str, dist_store.Pieces] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    moments = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            into = {"param": p.data.view(-1)}
            into.update({n: torch.zeros(p.numel()) for n in distopt.STATES[1:]})
            into["param"].zero_()  # the vocabulary's padding rows stay zero
            for prefix, offset, a, b in index.runs(
                local_ids(index, chunk, name, p, tp, grid.tp_rank)
            ):
                for state, tensor in into.items():
                    key = prefix + state
                    info = meta.get(key)
                    if info is None:
                        raise ConfigError(f"{root}: the store holds no {key}; add --no-load-optim")
                    dist_store.check_covered(key, info, [offset], [b - a], root)
                    pieces = wanted.setdefault(key, dist_store.Pieces(info.size))
                    same = pieces.pieces.get(torch.Size([offset]))
                    if same is not None:  # the same elements twice on this rank (tied copies)
                        copies.append((tensor[a:b], same))
                    else:
                        pieces.add([offset], tensor[a:b])
            moments.append((p, {n: into[n].view_as(p) for n in distopt.STATES[1:]}))
    load_store(root, wanted, dist_store.PiecesPlanner())
    for to, source in copies:
        to.copy_(source)
    return distopt.read_groups(root, meta, index.first, moments)
