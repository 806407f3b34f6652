"""megart train's whole state in Megatron-LM's torch_dist checkpoint (``--save --ckpt-format
torch_dist``), as Megatron-LM's generate_state_dict writes it with the non-distributed
optimizer: the format, its keys, and each rank's writing of it (--load of such a store into
any tensor/pipeline layout is megart.training.megatron_dist_train_load's). With
--use-distributed-optimizer the optimizer's part is the distributed optimizer's instead
(megart.training.megatron_dist_distopt: every data-parallel rank writes its slices; under
expert parallelism Megatron-Core's chain of two), and the fp32 main weights are there, not
under ``optimizer.state.fp32_param``.

The sharded store (each rank its own slices, megart.training.dist_store; places in
megart.training.megatron_dist_places):
- the model's weights under Megatron-Core's sharded keys, in the 16-bit type with --bf16/--fp16,
  and the routers' expert biases (--moe-router-enable-expert-bias) in fp32;
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

from megart.tensor_parallel.random import GeneratorStates
from megart.training import dist_store
from megart.training import megatron_dist_chain as chain
from megart.training import megatron_dist_distopt as distopt
from megart.training.dtypes import half_dtype
from megart.training.expert_grads import is_expert
from megart.training.megatron_dist import BACKENDS, COMMON, METADATA, extra_states
from megart.training.megatron_dist_places import Place, bias_places, places
from megart.training.megatron_files import CHECKPOINT_VERSION, to_grad_scaler, training_args
from megart.training.megatron_optimizer import megatron_group_keys
from megart.training.megatron_scheduler import scheduler_state

MOMENTS = ("exp_avg", "exp_avg_sq")
FP32 = "optimizer.state.fp32_param."
# Megatron-LM's content metadata without the distributed optimizer: the ChainedOptimizer of
# expert parallelism keeps the moments' keys unprefixed under it (with none it adds chained_N.).
PLAIN_CONTENT = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def moment_key(name: str, key: str) -> str:
    """The store's key of Adam's ``name`` state of the model's ``key``."""
    return f"optimizer.state.{name}.{key}"


def rng_key(pp_rank: int, tp_rank: int, pp: int, tp: int) -> str:
    """The ShardedObject key of a rank's random states (Megatron's unique_key)."""
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def _extra_states(chunks: list[Any]) -> dict[str, list[None]]:
    """The ``_extra_state`` objects of this rank's layers (and untied output layer)."""
    cfg, out = chunks[0].cfg, {}
    for chunk in chunks:
        owns_output = any(n == "output_layer.weight" for n, _ in chunk.named_parameters())
        output = owns_output and cfg.untie_embeddings_and_output_weights
        depths = any(n.startswith("mtp.") for n, _ in chunk.named_parameters())
        out.update(extra_states(chunk.layer_ids, cfg, output, depths))
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


def rank_state(
    config: Any, grid: Any, chunks: list[Any], optimizer: Any, rng: Any, scaler: Any = None
) -> dict[str, Any]:
    """This rank's slices of the store, copies of the live tensors (dist_store.Slices): the
    weights, random states and (non-distributed optimizer) moments of rank 0 of the data x
    context-parallel group (what Megatron-Core's replica ids name the main replica); with
    --use-distributed-optimizer every rank its slices of Megatron's bucket tensors, sharded
    over that group (megart.training.megatron_dist_distopt)."""
    half = half_dtype(config)
    state: dict[str, Any] = {}
    if hasattr(optimizer, "wait_for_params"):  # --overlap-param-gather leaves gathers running
        optimizer.wait_for_params()
    if config.use_distributed_optimizer:
        groups, step = distopt.param_groups(optimizer)
        keys = megatron_group_keys(config.lr, config.min_lr, config.decoupled_rates())
        groups = [{**k, **g, "step": step} for k, g in zip(keys, groups, strict=True)]
        args = vars(training_args(config, chunks[0].cfg, 0, grid.layout.dp))
        ep = getattr(config, "expert_model_parallel_size", 1)
        for part in chain.parts(grid, config.tp, ep, args):  # EP > 1: the chain's two
            mine = chain.part_groups(groups, optimizer, part.experts)
            scaled = _scaler_state(config, scaler)
            distopt.add_state(state, chunks, optimizer, part, grid.pp_rank, args, mine, scaled)
    # The weights are the same on every dp x cp rank: rank 0 of them writes the dense ones;
    # an expert's are the same on its expert-data-parallel ranks (Megatron-Core's replica ids
    # of SequentialMLP's tensors count over them): rank 0 of those writes it.
    dense = grid.dp_cp_rank == 0
    experts = getattr(grid, "edp_rank", grid.dp_cp_rank) == 0
    if not (dense or experts):
        return state

    def add(key: str, place: Place, tensor: torch.Tensor) -> None:
        state.setdefault(key, dist_store.Slices(place.size)).add(place.offsets, place.piece(tensor))

    for place in places(chunks, grid.tp_rank, config.tp):
        if not place.owner or not (experts if is_expert(place.param) else dense):
            continue
        p = place.param.detach()
        add(place.key, place, p if half is None else p.to(half))
        if half is not None and not config.use_distributed_optimizer:  # else in the buckets
            add(FP32 + place.key, place, p)
        own = None if config.use_distributed_optimizer else optimizer.state.get(place.param)
        for name in MOMENTS if own else ():
            add(moment_key(name, place.key), place, own[name])
    if not dense:
        return state
    for place in bias_places(chunks, grid.tp_rank):  # fp32 in 16-bit runs too, as Megatron's
        if place.owner:
            add(place.key, place, place.param.detach())
    if grid.tp_rank == 0:
        state.update(_extra_states(chunks))
    # Megatron-LM's data is a list (one entry per data-parallel rank, one without
    # --data-parallel-random-init); its torch_dist strategy stores a ShardedObject's data in
    # a list of its own (as the extra states' [None]).
    state[rng_key(grid.pp_rank, grid.tp_rank, config.pp, config.tp)] = [[_rng_record(rng)]]
    return state


def write_common(partial: Path, common: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote: the store's merged metadata, ``common`` (common_state's)
    as common.pt, and metadata.json."""
    dist_store.merge(partial, dist_store.written_ranks(partial))
    torch.save(common, partial / COMMON)
    (partial / METADATA).write_text(json.dumps(BACKENDS))


def common_state(
    config: Any,
    chunks: list[Any],
    dp: int,
    optimizer: Any,
    scaler: Any,
    iteration: int,
    consumed: int,
) -> dict[str, Any]:
    """What common.pt holds (see the module's description)."""
    cfg = chunks[0].cfg
    args = training_args(config, cfg, iteration, dp)
    args.ckpt_format = "torch_dist"
    args.consumed_train_samples = consumed
    common: dict[str, Any] = {}
    if config.use_distributed_optimizer:  # the rest is in the store (megatron_dist_distopt)
        opt: dict[Any, Any] = {"param_state_sharding_type": distopt.SHARDING}
        if getattr(config, "expert_model_parallel_size", 1) > 1:  # the chain: each its own
            opt = {0: opt, 1: dict(opt)}
        common["content_metadata"] = dict(distopt.CONTENT)
    elif getattr(config, "expert_model_parallel_size", 1) > 1:
        # Megatron-Core's ChainedOptimizer (the dense parameters', then the experts'): its
        # sharded_state_dict leaves {index: each one's} here; under Megatron-LM's metadata
        # (chained_optim_avoid_prefix, no distributed optimizer) the moments' keys are the
        # model's, as one optimizer's.
        opt = {
            i: _plain_optimizer(config, optimizer, scaler, part)
            for i, part in enumerate((False, True))
        }
    else:
        opt = _plain_optimizer(config, optimizer, scaler)
    if not config.use_distributed_optimizer:  # as Megatron-LM >= 0.13 writes it
        common["content_metadata"] = dict(PLAIN_CONTENT)
    args.expert_model_parallel_size = getattr(config, "expert_model_parallel_size", 1)
    common |= {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "optimizer": opt,
        "opt_param_scheduler": scheduler_state(config, iteration, consumed),
        "megart": {"model_config": dataclasses.asdict(cfg)},
    }
    return common


def _plain_optimizer(
    config: Any, optimizer: Any, scaler: Any, experts: bool | None = None
) -> dict[str, Any]:
    """Megatron's FP32Optimizer's (or with --bf16/--fp16 Float16OptimizerWithFloat16Params')
    part of common.pt: the param groups without their params, the one step. ``experts``: under
    expert parallelism, the chain's optimizer of the experts' parameters (True) or of the
    others (False), holding only its own non-empty groups, keyed ``is_expert_parallel``, as
    Megatron-Core's _get_param_groups makes them."""
    keys = megatron_group_keys(config.lr, config.min_lr, config.decoupled_rates())
    groups = []
    for k, g, live in zip(keys, optimizer.state_dict()["param_groups"], optimizer.param_groups,
                          strict=True):  # fmt: skip
        if experts is not None:
            if not any(is_expert(p) == experts for p in live["params"]):
                continue
            k = {**k, "is_expert_parallel": experts}
        groups.append({**k, **{n: v for n, v in g.items() if n != "params"}})
    steps = [s["step"] for s in optimizer.state.values() if "step" in s]
    opt: dict[str, Any] = {"param_groups": groups, "state": {}}
    if steps:  # Megatron-Core's _extract_common_per_param_step: one step for all
        opt["state"]["common_step"] = steps[0].detach().clone()
    if half_dtype(config) is not None:
        opt = {"optimizer": opt}
        if scaler is not None:
            opt["grad_scaler"] = _scaler_state(config, scaler)
    return opt


def _scaler_state(config: Any, scaler: Any) -> dict[str, Any] | None:
    """The loss scaler as Megatron's grad scaler state (a static --loss-scale is its
    ConstantGradScaler: {})."""
    if scaler is None:
        return None
    return {} if config.loss_scale else to_grad_scaler(scaler.state_dict(), config.hysteresis)
