"""megart train's whole state in Megatron-LM's torch_dist checkpoint (``--save --ckpt-format
torch_dist``), as Megatron-LM's generate_state_dict writes it with the non-distributed
optimizer, and --load of such a store into any tensor/pipeline layout. With
--use-distributed-optimizer the optimizer's part is the distributed optimizer's instead
(megart.training.megatron_dist_distopt: every data-parallel rank writes its slices), and the
fp32 main weights are there, not under ``optimizer.state.fp32_param``.

The sharded store (each rank its own slices, megart.training.dist_store; places in
megart.training.megatron_dist_places):
- the model's weights under Megatron-Core's sharded keys, in the 16-bit type with --bf16/--fp16;
- the Adam moments under the keys Megatron-Core's ``optim_state_to_sharding_state`` makes from
  the model's (``optimizer.state.exp_avg.<key>``, ``optimizer.state.exp_avg_sq.<key>``, the same
  slices), and with --bf16/--fp16 the fp32 main weights as Float16OptimizerWithFloat16Params
  keys them (``optimizer.state.fp32_param.<key>``): megart's fp32 parameters are those;
- each linear layer's ``_extra_state`` (None) and the random states as Megatron-LM's
  ``get_rng_state`` makes a ShardedObject of them: ``rng_state``, one per (pipeline, tensor)
  rank, written by data-parallel rank 0, megart's own tracker streams beside Megatron's keys.

``common.pt`` (rank 0): ``args`` (consumed_train_samples in them), ``checkpoint_version``,
``iteration``, ``optimizer`` as Megatron-Core's sharded_state_dict leaves it outside the store
(the param groups without their ``params``, the shared step as ``state.common_step``; with
--bf16/--fp16 nested under ``optimizer`` beside ``grad_scaler``), ``opt_param_scheduler``, and
``megart`` (megart's whole model config, which Megatron ignores).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from megart.errors import ConfigError
from megart.tensor_parallel.random import GeneratorStates
from megart.training import dist_store
from megart.training import megatron_dist_distopt as distopt
from megart.training.dist_store import Pieces, PiecesPlanner
from megart.training.megatron_dist import (
    BACKENDS,
    COMMON,
    METADATA,
    extra_states,
    load_store,
    stored,
)
from megart.training.megatron_dist_distopt_reshard import read_resharded
from megart.training.megatron_dist_places import VOCAB_KEYS, Place, places
from megart.training.megatron_files import (
    CHECKPOINT_VERSION,
    from_grad_scaler,
    to_grad_scaler,
    training_args,
)
from megart.training.megatron_optimizer import megatron_group_keys
from megart.training.megatron_scheduler import check_scheduler, scheduler_state

MOMENTS = ("exp_avg", "exp_avg_sq")
FP32 = "optimizer.state.fp32_param."


def moment_key(name: str, key: str) -> str:
    """The store's key of Adam's ``name`` state of the model's ``key``."""
    return f"optimizer.state.{name}.{key}"


def rng_key(pp_rank: int, tp_rank: int, pp: int, tp: int) -> str:
    """The ShardedObject key of a rank's random states (Megatron's unique_key)."""
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def _half(config: Any) -> torch.dtype | None:
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None


def _extra_states(chunks: list[Any]) -> dict[str, list[None]]:
    """The ``_extra_state`` objects of this rank's layers (and untied output layer)."""
    cfg, out = chunks[0].cfg, {}
    for chunk in chunks:
        owns_output = any(n == "output_layer.weight" for n, _ in chunk.named_parameters())
        output = owns_output and cfg.untie_embeddings_and_output_weights
        out.update(extra_states(chunk.layer_ids, cfg.num_layers, output))
    return out


def _rng_record(rng: Any) -> dict[str, Any]:
    """This rank's random states as Megatron-LM's get_rng_state has them (its tracker's
    streams are CUDA ones; megart's CPU streams ride along under ``megart_rng_tracker``)."""
    default = GeneratorStates.current()
    tracker = rng.get_states()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": default.cpu,
        "cuda_rng_state": default.cuda,
        "rng_tracker_states": {
            n: cpu if cuda is None else cuda for n, (cpu, cuda) in tracker.items()
        },
        "megart_rng_tracker": tracker,
    }


def write_rank(
    partial: Path,
    rank: int,
    config: Any,
    grid: Any,
    chunks: list[Any],
    optimizer: Any,
    rng: Any,
    scaler: Any = None,
) -> None:
    """Writes this rank's slices into the store in ``partial``: data-parallel rank 0's
    weights, random states and (non-distributed optimizer) moments; with
    --use-distributed-optimizer every rank its slices of Megatron's bucket tensors
    (megart.training.megatron_dist_distopt)."""
    half = _half(config)
    state: dict[str, Any] = {}
    if hasattr(optimizer, "wait_for_params"):  # --overlap-param-gather leaves gathers running
        optimizer.wait_for_params()
    if config.use_distributed_optimizer:
        groups, step = distopt.param_groups(optimizer)
        keys = megatron_group_keys(config.lr, config.min_lr, config.decoupled_rates())
        groups = [{**k, **g, "step": step} for k, g in zip(keys, groups, strict=True)]
        args = vars(training_args(config, chunks[0].cfg, 0, grid.layout.dp))
        distopt.add_state(
            state, chunks, optimizer, grid, config.tp, args, groups, _scaler_state(config, scaler)
        )
    if grid.dp_rank != 0:
        dist_store.write_rank(partial, rank, state)
        return

    def add(key: str, place: Place, tensor: torch.Tensor) -> None:
        state.setdefault(key, dist_store.Slices(place.size)).add(place.offsets, place.piece(tensor))

    for place in places(chunks, grid.tp_rank, config.tp):
        if not place.owner:
            continue
        p = place.param.detach()
        add(place.key, place, p if half is None else p.to(half))
        if half is not None and not config.use_distributed_optimizer:  # else in the buckets
            add(FP32 + place.key, place, p)
        own = None if config.use_distributed_optimizer else optimizer.state.get(place.param)
        for name in MOMENTS if own else ():
            add(moment_key(name, place.key), place, own[name])
    if grid.tp_rank == 0:
        state.update(_extra_states(chunks))
    # Megatron-LM's data is a list (one entry per data-parallel rank, one without
    # --data-parallel-random-init); its torch_dist strategy stores a ShardedObject's data in
    # a list of its own (as the extra states' [None]).
    state[rng_key(grid.pp_rank, grid.tp_rank, config.pp, config.tp)] = [[_rng_record(rng)]]
    dist_store.write_rank(partial, rank, state)


def finish(
    partial: Path,
    config: Any,
    chunks: list[Any],
    dp: int,
    optimizer: Any,
    scaler: Any,
    iteration: int,
    consumed: int,
) -> None:
    """Rank 0, after every rank wrote: the store's merged metadata, common.pt and
    metadata.json."""
    dist_store.merge(partial, dist_store.written_ranks(partial))
    cfg = chunks[0].cfg
    args = training_args(config, cfg, iteration, dp)
    args.ckpt_format = "torch_dist"
    args.consumed_train_samples = consumed
    common: dict[str, Any] = {}
    if config.use_distributed_optimizer:  # the rest is in the store (megatron_dist_distopt)
        opt: dict[str, Any] = {"param_state_sharding_type": distopt.SHARDING}
        common["content_metadata"] = dict(distopt.CONTENT)
    else:
        keys = megatron_group_keys(config.lr, config.min_lr, config.decoupled_rates())
        groups = [
            {**k, **{n: v for n, v in g.items() if n != "params"}}
            for k, g in zip(keys, optimizer.state_dict()["param_groups"], strict=True)
        ]
        steps = [s["step"] for s in optimizer.state.values() if "step" in s]
        opt = {"param_groups": groups, "state": {}}
        if steps:  # Megatron-Core's _extract_common_per_param_step: one step for all
            opt["state"]["common_step"] = steps[0].detach().clone()
        if _half(config) is not None:
            opt = {"optimizer": opt}
            if scaler is not None:
                opt["grad_scaler"] = _scaler_state(config, scaler)
    common |= {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "optimizer": opt,
        "opt_param_scheduler": scheduler_state(config, iteration, consumed),
        "megart": {"model_config": dataclasses.asdict(cfg)},
    }
    torch.save(common, partial / COMMON)
    (partial / METADATA).write_text(json.dumps(BACKENDS))


def _scaler_state(config: Any, scaler: Any) -> dict[str, Any] | None:
    """The loss scaler as Megatron's grad scaler state (a static --loss-scale is its
    ConstantGradScaler: {})."""
    if scaler is None:
        return None
    return {} if config.loss_scale else to_grad_scaler(scaler.state_dict(), config.hysteresis)


def _foreign(root: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"{root}: {problem}: its optimizer state is not the non-distributed optimizer's of "
        "this model (Megatron-LM's --use-distributed-optimizer keys it otherwise); add "
        "--finetune (its weights, from iteration 0) or --no-load-optim (its weights and "
        "iteration, a fresh optimizer)"
    )


class _Reads:
    """The slices this rank reads, per key, checked against the store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meta = stored(root)
        self.wanted: dict[str, Pieces] = {}
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, key: str, place: Place, tensor: torch.Tensor) -> None:
        meta = self.meta.get(key)
        vocab = place.key in VOCAB_KEYS
        if not isinstance(meta, dcp.metadata.TensorStorageMetadata):
            problem = f"the store holds no {key}"
        elif tuple(meta.size)[vocab:] != tuple(place.size)[vocab:]:
            problem = f"{key} has shape {list(meta.size)}, this model's {list(place.size)}"
        else:
            problem = None
        if problem is not None and key.startswith("optimizer."):
            raise _foreign(self.root, problem)
        if problem is not None:
            raise ConfigError(f"{self.root}: {problem}; resume with the flags of its model")
        offsets, piece = place.offsets, place.piece(tensor)
        if vocab:  # rows past the stored padding stay zero (megart.models.config.fit_vocab)
            rows = max(0, min(piece.shape[0], meta.size[0] - offsets[0]))
            piece[rows:].zero_()
            piece = piece[:rows]
        if not piece.numel():
            return
        dist_store.check_covered(key, meta, offsets, piece.shape, self.root)
        pieces = self.wanted.setdefault(key, Pieces(meta.size))
        same = pieces.pieces.get(torch.Size(offsets))
        if same is not None:  # a tied embedding's two copies on one rank: read once
            self.copies.append((piece, same))
        else:
            pieces.add(offsets, piece)

    def load(self) -> None:
        load_store(self.root, self.wanted, PiecesPlanner())
        for to, source in self.copies:
            to.copy_(source)


def _install(optimizer: Any, moments: list, step: Any) -> None:
    """Gives ``optimizer`` the loaded moments through its load_state_dict of a plain
    optimizer's state dict (its own param groups, parameters numbered over them): megart's
    Adam, or its distributed optimizer, which keeps this rank's slices of them (its
    state_dict is a collective: every rank loads)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    number = {id(p): i for i, p in enumerate(params)}
    value = float(step) if step is not None else 0.0
    state = {number[id(p)]: {"step": torch.tensor(value), **m} for p, m in moments}
    groups = optimizer.state_dict()["param_groups"]  # numbered the same way
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load(
    root: Path,
    common: dict[str, Any],
    config: Any,
    grid: Any,
    chunks: list[Any],
    optimizer: Any,
    rng: Any,
    scaler: Any,
    load_optim: bool,
    load_rng: bool,
    directory: Any,
) -> str:
    """Restores into this rank's chunks (any layout) its slices of the torch_dist store in
    ``root``: the weights (the fp32 main weights where the store has them); with
    ``load_optim`` Adam's moments and step and the fp16 loss scaler, after Megatron's check of
    the scheduler's state against this run's flags; with ``load_rng`` the random streams where
    the layout is the saved one (else this run keeps its own, as resharding does). The
    distributed optimizer's store is megart.training.megatron_dist_distopt's; a store with
    neither optimizer's keys for this model is refused, naming --finetune and
    --no-load-optim. Returns what it left out, for the log."""
    reads = _Reads(root)
    saved = common.get("optimizer") or {}
    if load_optim and distopt.is_distributed(common):
        grad_scaler = _load_distributed(
            root, reads.meta, common, config, grid, chunks, optimizer, directory
        )
        if scaler is not None and grad_scaler:  # the store's object; common.pt has none
            scaler.load_state_dict(from_grad_scaler(grad_scaler))
        return _load_rng(root, reads.meta, config, grid, rng) if load_rng else ""
    nested = "optimizer" in saved  # Float16OptimizerWithFloat16Params's layout
    inner = saved.get("optimizer", saved)
    if load_optim:
        check_scheduler(common.get("opt_param_scheduler") or {}, config, directory)
        groups = inner.get("param_groups")
        if groups is None:
            raise _foreign(root, "its common.pt holds no optimizer param groups")
        _check_groups(groups, optimizer, directory)
    # The fp32 main weights where the store has them (--bf16/--fp16), not their 16-bit casts.
    main = FP32 if load_optim and nested else ""
    moments: list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]] = []
    with torch.no_grad():
        for place in places(chunks, grid.tp_rank, config.tp):
            reads.add(main + place.key, place, place.param.detach())
            if load_optim:
                state = {n: torch.zeros_like(place.param, dtype=torch.float32) for n in MOMENTS}
                for name, tensor in state.items():
                    reads.add(moment_key(name, place.key), place, tensor)
                moments.append((place.param, state))
        reads.load()
    if load_optim:
        _install(optimizer, moments, inner.get("state", {}).get("common_step"))
    if load_optim and scaler is not None and saved.get("grad_scaler"):
        scaler.load_state_dict(from_grad_scaler(saved["grad_scaler"]))
    return _load_rng(root, reads.meta, config, grid, rng) if load_rng else ""


def _check_groups(groups: list[Any], optimizer: Any, directory: Any) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ConfigError(
            f"--load {directory}: its optimizer has {len(groups)} param groups, this "
            f"run's {len(optimizer.param_groups)}; resume with the saved --decoupled-lr, "
            "or add --no-load-optim"
        )


def _load_distributed(
    root: Path,
    meta: dict[str, Any],
    common: dict[str, Any],
    config: Any,
    grid: Any,
    chunks: list[Any],
    optimizer: Any,
    directory: Any,
) -> dict[str, Any] | None:
    """The distributed optimizer's store (megart.training.megatron_dist_distopt): the fp32
    main weights and moments from this rank's group's buckets and the step from its objects,
    into any layout. Returns the stored grad scaler state (None without one)."""
    check_scheduler(common.get("opt_param_scheduler") or {}, config, directory)
    args = vars(common["args"])
    distopt.check_sharding(root, common["optimizer"]["param_state_sharding_type"])
    # Megatron-LM reads only the saved tensor/pipeline layout; megart reshards the rest.
    read = distopt.read_state if distopt.same_layout(args, config) else read_resharded
    with torch.no_grad():
        moments, step, groups, grad_scaler = read(root, meta, args, grid, config.tp, chunks)
    _check_groups(groups, optimizer, directory)
    _install(optimizer, moments, step)
    return grad_scaler


def _load_rng(root: Path, meta: dict[str, Any], config: Any, grid: Any, rng: Any) -> str:
    """This rank's random streams, where the store has them for this layout."""
    key = rng_key(grid.pp_rank, grid.tp_rank, config.pp, config.tp)
    if key not in meta:
        return "; its random states are of another layout: this run keeps its own"
    record = {key: None}
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    load_store(root, record, planner)
    try:
        r = record[key][0][0]  # the strategy's list around Megatron's list per data rank
        states = GeneratorStates(r["torch_rng_state"], r.get("cuda_rng_state"))
    except (TypeError, IndexError, KeyError) as e:
        raise ConfigError(
            f"{root}: its {key} is not Megatron-LM's random states ({e!r}); add --no-load-rng"
        ) from e
    states.install()
    if r.get("megart_rng_tracker") is not None:  # Megatron-LM's are CUDA streams: not taken
        rng.set_states(r["megart_rng_tracker"])
    return ""
