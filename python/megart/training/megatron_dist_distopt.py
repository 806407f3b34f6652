"""The distributed optimizer's state in Megatron-LM's torch_dist store (``--save --ckpt-format
torch_dist --use-distributed-optimizer``), written by each rank from its own slices and read
back by any data-parallel size.

Megatron-LM's save_checkpoint (megatron-core 0.16.1) asks DistributedOptimizer
.sharded_state_dict for ``distrib_optim_sharding_type`` "dp_reshardable" unless
--dist-ckpt-optim-fully-reshardable is given (the default). That layout follows the optimizer's
own buffers (megart.training.megatron_distrib_optim: a model chunk's parameters in reverse
order, each at a multiple of 64 elements, cut into buckets): for each bucket ``k`` of buffer
(model chunk) ``g`` of the (tensor, pipeline) rank numbered ``G = tp_rank + tp x pp_rank``
(its model-parallel rank), one 1-D fp32 tensor per state,

    optimizer.distributed.dp_group_idx_G.gbuf_idx_g.dtype_(<param dtype>, <grad dtype>)
        .bucket_idx_k.{param,exp_avg,exp_avg_sq}

of the bucket's length without its end padding (``numel_unpadded``, which does not depend on
the data-parallel size): the fp32 main weights and Adam's moments flattened at each parameter's
place, the gaps between parameters covered too (Megatron writes them uninitialised; megart
zeros). Under context parallelism the optimizer shards over the d x cp ranks (Megatron-Core's
intra_dp_cp group), whose size pads the buckets; the tensors are the same. Beside them,
ShardedObjects written by rank 0 of each group's d x cp ranks:
``...dp_group_idx_G.optimizer`` (DistributedOptimizer.state_dict()'s param groups, each with
its ``step``), ``.grad_scaler`` under --fp16/--bf16 with a scaler, and ``.per_bucket_numel`` /
``.per_bucket_numel_unpadded`` (per buffer, ``{(param dtype, grad dtype): [per bucket]}``).
common.pt's ``optimizer`` is ``{"param_state_sharding_type": "dp_reshardable"}`` and its
``content_metadata`` says the same.

Under expert parallelism the store holds Megatron-Core's chain of two such optimizers, the
dense parameters' and the experts' (megart.training.megatron_dist_chain says how each is keyed,
sharded and numbered); ``buffers`` and ``add_state`` then take one part of it.

Because the tensors follow one tensor/pipeline layout's buffers, Megatron-LM reads them only
into that layout (any data-parallel size). megart reads them into that layout directly and
into any other through an index of where each element lies
(megart.training.megatron_dist_distopt_reshard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from megart.errors import ConfigError
from megart.models.megatron_names import megatron_layer_name
from megart.models.stages import chunk_layers
from megart.training import dist_store
from megart.training.expert_grads import is_expert
from megart.training.megatron_args import saved_stages
from megart.training.megatron_distrib_optim import BUCKET_ALIGN, dp_cp_size, dtype_key, layouts
from megart.training.megatron_files import chunk_names_to_megatron, chunk_to_megatron

SHARDING = "dp_reshardable"
STATES = ("param", "exp_avg", "exp_avg_sq")
CONTENT = {
    "distrib_optim_sharding_type": SHARDING,
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


def group_prefix(tp_rank: int, pp_rank: int, tp: int) -> str:
    """The keys' prefix of a (tensor, pipeline) rank: its rank in the model-parallel group."""
    return f"optimizer.distributed.dp_group_idx_{tp_rank + tp * pp_rank}."


def object_key(prefix: str, name: str) -> str:
    """A ShardedObject's key in the store (Megatron-Core's unique_key of one shard)."""
    return f"{prefix}{name}/shard_0_1"


def bucket_key(prefix: str, gbuf: int, dtype: tuple[torch.dtype, torch.dtype], bucket: int) -> str:
    """The keys' common part of one bucket's tensors (its states follow: ``param``, ...)."""
    return f"{prefix}gbuf_idx_{gbuf}.dtype_{dtype}.bucket_idx_{bucket}."


def check_buckets(
    root: Path, prefix: str, expected: list[dict[Any, list[int]]], meta: dict | None = None
) -> None:
    """Refuses a store whose group ``prefix`` has other bucket lengths than this model laid
    out as Megatron-Core does for the saved flags (or, given its ``meta``, none)."""
    key = object_key(prefix, "per_bucket_numel_unpadded")
    if meta is not None and key not in meta:
        raise ConfigError(
            f"{root}: the store holds no {key}; not Megatron's {SHARDING} layout of this "
            "model's optimizers (saved with other parallel sizes?); resume with --no-load-optim"
        )
    stored = read_object(root, key)
    if stored != expected:
        raise ConfigError(
            f"{root}: {prefix}'s buckets hold {stored} elements where this model's parameters, "
            f"laid out as Megatron-Core does for the saved flags, take {expected} (saved with "
            "other --ddp-bucket-size, --ddp-num-buckets or precision flags?); resume with "
            "--no-load-optim"
        )


@dataclass
class Span:
    """Where one megart parameter lies in Megatron's buffers: elements [start, start + numel)
    of bucket ``bucket`` of buffer ``gbuf``."""

    gbuf: int
    bucket: int
    start: int
    numel: int


@dataclass
class Buffers:
    """This rank's buffers as Megatron lays them out: each buffer's bucket lengths (without
    end padding) and dtype key, every parameter's Span, and the size of the data x
    context-parallel group they are sharded over."""

    buckets: list[tuple[int, ...]]
    dtype: tuple[torch.dtype, torch.dtype]
    spans: dict[int, Span]  # id(parameter) -> Span
    dp: int

    def key(self, prefix: str, gbuf: int, bucket: int, state: str) -> str:
        return bucket_key(prefix, gbuf, self.dtype, bucket) + state

    def numel(self, unpadded: bool) -> list[dict[Any, list[int]]]:
        """per_bucket_numel(_unpadded) as Megatron-Core keeps it: the end padding rounds each
        bucket up to a multiple of lcm(data x context-parallel size, 128)."""
        align = 1 if unpadded else math.lcm(self.dp, BUCKET_ALIGN)
        return [{self.dtype: [-(-n // align) * align for n in b]} for b in self.buckets]


def _megatron_name(name: str, chunk: Any) -> tuple[str, int | None]:
    """A megart parameter's Megatron-Core name in its chunk, and which half of that tensor it
    is (megart.models.megatron_names.megatron_layer_name: GATE or UP of SwiGLU's ``linear_fc1``,
    None for the whole tensor)."""
    cfg = chunk.cfg
    parts = name.removeprefix("chunk.").split(".", 2)
    if parts[0] == "blocks":
        megatron, half = megatron_layer_name(parts[2], cfg)
        if half is not None:  # to_megatron writes a half only beside the other
            return f"decoder.layers.{parts[1]}.{megatron}", half
    meta = torch.empty(0, device="meta")
    ((megatron, _),) = chunk_names_to_megatron({name: meta}, cfg, list(chunk.layer_ids)).items()
    return megatron, None


def buffers(chunks: list[Any], args: dict[str, Any], pp_rank: int, part: Any = None) -> Buffers:
    """Megatron-Core's buffers of this rank's model chunks for the run's flags ``args``
    (Megatron's names: bucket sizes, precision, data-parallel size); with ``part`` of a
    chain, of its parameters only (a chunk without any has no buffer), their bucket size from
    all the rank's parameters (--ddp-num-buckets), sharded over the part's ranks."""
    experts = None if part is None else part.experts
    named = [
        [(n, p) for n, p in chunk.named_parameters() if experts is None or is_expert(p) == experts]
        for chunk in chunks
    ]
    total = None
    if experts is not None:
        total = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        chunks, named = (
            [c for c, n in zip(chunks, named, strict=True) if n],
            [n for n in named if n],
        )
    megatron_chunks = [
        chunk_to_megatron(
            {n: torch.empty(p.shape, device="meta") for n, p in params}, chunk.cfg,
            list(chunk.layer_ids),
        )
        for chunk, params in zip(chunks, named, strict=True)
    ]  # fmt: skip
    shard = dp_cp_size(args) if part is None else part.shard
    spans: dict[int, Span] = {}
    per_buffer = []
    for g, (chunk, params, layout) in enumerate(
        zip(chunks, named, layouts(megatron_chunks, args, pp_rank, total, shard), strict=True)
    ):
        for name, p in params:
            megatron, half = _megatron_name(name, chunk)
            # The gate and up halves have one shape: the up half starts one parameter in.
            k, offset = layout.locate(layout.ranges[megatron][0] + (half or 0) * p.numel())
            spans[id(p)] = Span(g, k, offset, p.numel())
        per_buffer.append(layout.buckets)
    return Buffers(per_buffer, dtype_key(args), spans, shard)


def _owned(optimizer: Any, params: list[Any], rank: int) -> list[tuple[Any, int, dict]]:
    """(parameter, first element, {state: 1-D tensor}) of each slice of ``params`` this rank
    writes: the distributed optimizer's pieces, or (the plain optimizer, rank 0 of the ranks
    sharing them) whole parameters."""
    if hasattr(optimizer, "pieces"):
        mine = {id(p) for p in params}
        out = []
        for piece in optimizer.pieces:
            if id(piece.param) in mine:
                state = optimizer.optimizer.state.get(piece.data, {})
                out.append((piece.param, piece.start, {"param": piece.data, **state}))
        return out
    if rank != 0:
        return []
    return [(p, 0, {"param": p.detach().reshape(-1), **optimizer.state.get(p, {})}) for p in params]


def param_groups(optimizer: Any) -> tuple[list[dict[str, Any]], float]:
    """The optimizer's param groups without their params, and its step, without a
    collective (the distributed optimizer's state_dict gathers)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    if hasattr(optimizer, "steps"):
        return groups, float(optimizer.steps)
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return groups, steps[0] if steps else 0.0


def add_state(
    state: dict[str, Any],
    chunks: list[Any],
    optimizer: Any,
    part: Any,
    pp_rank: int,
    args: dict[str, Any],
    groups: list[dict[str, Any]],
    grad_scaler: dict[str, Any] | None,
) -> None:
    """Adds to ``state`` (a rank's part of the store) this rank's slices of the bucket tensors
    of its optimizer ``part`` (megart.training.megatron_dist_chain.Part); rank 0 of the
    part's ranks adds the gaps between parameters (zeros) and the group's objects.
    ``groups``: Megatron's param groups, each with its step."""
    bufs = buffers(chunks, args, pp_rank, part)
    prefix = part.prefix
    params = [p for chunk in chunks for p in chunk.parameters() if id(p) in bufs.spans]

    def add(gbuf: int, bucket: int, name: str, at: int, data: torch.Tensor) -> None:
        key = bufs.key(prefix, gbuf, bucket, name)
        size = torch.Size([bufs.buckets[gbuf][bucket]])
        state.setdefault(key, dist_store.Slices(size)).add([at], data.detach().float())

    for p, start, tensors in _owned(optimizer, params, part.rank):
        span = bufs.spans[id(p)]
        for name in STATES:  # no moments before the first step: zeros, as a fresh Adam's
            data = tensors.get(name, torch.zeros_like(tensors["param"]))
            add(span.gbuf, span.bucket, name, span.start + start, data.reshape(-1))
    if part.rank != 0:
        return
    for gbuf, lengths in enumerate(bufs.buckets):
        for bucket, length in enumerate(lengths):
            taken = sorted(
                (s.start, s.start + s.numel)
                for s in bufs.spans.values()
                if (s.gbuf, s.bucket) == (gbuf, bucket)
            )
            at = 0
            for start, end in [*taken, (length, length)]:
                if start > at:
                    for name in STATES:
                        add(gbuf, bucket, name, at, torch.zeros(start - at))
                at = max(at, end)
    # ShardedObjects: Megatron-Core's torch_dist strategy stores each one's data in a list.
    state[object_key(prefix, "optimizer")] = [{"param_groups": groups}]
    if grad_scaler is not None:
        state[object_key(prefix, "grad_scaler")] = [grad_scaler]
    state[object_key(prefix, "per_bucket_numel")] = [bufs.numel(unpadded=False)]
    state[object_key(prefix, "per_bucket_numel_unpadded")] = [bufs.numel(unpadded=True)]


def sharding_of(common: dict[str, Any]) -> Any:
    """The distributed optimizer's sharding type a store's common.pt records (under expert
    parallelism each optimizer of the chain's, ``{0: dense, 1: experts}``, the same), or None
    for the non-distributed optimizer's store."""
    saved = common.get("optimizer")
    if isinstance(saved, dict) and 0 in saved and 1 in saved:
        saved = saved[0]
    return saved.get("param_state_sharding_type") if isinstance(saved, dict) else None


def is_distributed(common: dict[str, Any]) -> bool:
    """Whether a store's common.pt says its optimizer state is the distributed optimizer's."""
    return sharding_of(common) is not None


def read_object(root: Path, key: str) -> Any:
    """One ShardedObject's data from the store (the strategy's list around it)."""
    from megart.training.megatron_dist import load_store

    record: dict[str, Any] = {key: None}
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    load_store(root, record, planner)
    return record[key][0]


def check_sharding(root: Path, sharding: Any) -> None:
    """Refuses another of Megatron's sharding types than the one megart reads."""
    if sharding != SHARDING:
        raise ConfigError(
            f"{root}: its distributed optimizer state is Megatron's {sharding!r} layout; "
            f"megart reads {SHARDING!r} (Megatron-LM's default); add --no-load-optim (its "
            "weights and iteration, a fresh optimizer) or --finetune"
        )


def saved_layout(args: dict[str, Any]) -> tuple[int, int, int]:
    """(tensor, pipeline, virtual pipeline) sizes of the saved ranks; Megatron-LM records the
    model chunks per rank as the virtual size or (older flag) as layers per virtual stage."""
    tp = int(args.get("tensor_model_parallel_size") or 1)
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    per = args.get("num_layers_per_virtual_pipeline_stage")
    vpp = args.get("virtual_pipeline_model_parallel_size") or (
        int(args["num_layers"]) // (pp * per) if per else 1
    )
    return tp, pp, int(vpp)


def same_layout(args: dict[str, Any], config: Any) -> bool:
    """Whether this run's model chunks are the saved ones (its buffers are the store's): the
    same sizes and each chunk the same layers (uneven stages can differ at the same sizes), and
    the same experts (another expert-parallel size holds others: read resharded)."""
    vpp = config.chunks if config.schedule == "interleaved" else 1
    if saved_layout(args) != (config.tp, config.pp, vpp) or config.schedule == "zb-v":
        return False
    ep = getattr(config, "expert_model_parallel_size", 1)
    if (args.get("expert_model_parallel_size") or 1) != ep:
        return False
    n, pp = config.num_layers, config.pp
    saved, mine = saved_stages(args), config.stages
    return all(
        chunk_layers(n, r, pp, vpp, **saved) == chunk_layers(n, r, pp, vpp, **mine)
        for r in range(pp)
    )


def read_state(
    root: Path, meta: dict[str, Any], args: dict[str, Any], grid: Any, tp: int, chunks: list[Any]
) -> tuple[list[tuple[Any, dict[str, torch.Tensor]]], float, list[dict[str, Any]], Any]:
    """This rank's parameters' fp32 main weights (into the parameters) and Adam moments from
    its group's bucket tensors, each region checked to be stored exactly once. Returns the
    moments per parameter, the step, the saved param groups and grad scaler state (or None)."""
    from megart.training.megatron_dist import load_store

    bufs = buffers(chunks, args, grid.pp_rank)
    prefix = group_prefix(grid.tp_rank, grid.pp_rank, tp)
    numel_key = object_key(prefix, "per_bucket_numel_unpadded")
    if numel_key not in meta:
        raise ConfigError(f"{root}: the store holds no {numel_key}; not Megatron's {SHARDING}")
    check_buckets(root, prefix, bufs.numel(unpadded=True))
    wanted: dict[str, dist_store.Pieces] = {}
    moments = []
    for p in (p for chunk in chunks for p in chunk.parameters()):
        span = bufs.spans[id(p)]
        into = {"param": p.data.view(-1)}
        into.update({n: torch.zeros(p.numel()) for n in STATES[1:]})
        for name, tensor in into.items():
            key = bufs.key(prefix, span.gbuf, span.bucket, name)
            info = meta.get(key)
            if not isinstance(info, dcp.metadata.TensorStorageMetadata):
                raise ConfigError(f"{root}: the store holds no {key}; resume with --no-load-optim")
            dist_store.check_covered(key, info, [span.start], [span.numel], root)
            wanted.setdefault(key, dist_store.Pieces(info.size)).add([span.start], tensor)
        moments.append((p, {n: into[n].view_as(p) for n in STATES[1:]}))
    load_store(root, wanted, dist_store.PiecesPlanner())
    return read_groups(root, meta, prefix, moments)


def read_groups(
    root: Path, meta: dict[str, Any], prefix: str, moments: list
) -> tuple[list, float, list[dict[str, Any]], Any]:
    """``moments`` with the step, param groups and grad scaler state (or None) of the group
    ``prefix`` (every group holds the same)."""
    record = read_object(root, object_key(prefix, "optimizer"))
    groups = record.get("param_groups") or []
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) > 1:
        raise ConfigError(f"{root}: its param groups were stepped {sorted(steps)} times")
    scaler_key = object_key(prefix, "grad_scaler")
    scaler = read_object(root, scaler_key) if scaler_key in meta else None
    return moments, steps.pop() if steps else 0.0, groups, scaler
