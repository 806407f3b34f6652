"""One rank's file of Megatron-LM's legacy checkpoint (``--ckpt-format torch``): its ``args``,
its keys, and the whole training state megart train writes in it.

Megatron-LM's ``generate_state_dict`` (megatron/training/checkpointing.py) writes, per tensor-
and pipeline-parallel rank (data-parallel rank 0): ``args`` (an argparse Namespace of its
flags), ``checkpoint_version`` 3.0, ``iteration``, ``model`` (``model0``, ``model1``, ... under
interleaving: the module state dicts, see megart.training.megatron_layout), ``optimizer``,
``opt_param_scheduler`` and ``rng_state``. The non-distributed optimizer's state dict is
torch's (``state``, ``param_groups``) in fp32 (FP32Optimizer); with --fp16/--bf16
(Float16OptimizerWithFloat16Params) it is ``{"optimizer": torch's, "fp32_from_fp16_params":
[[fp32 master of each parameter] per param group], "grad_scaler": ...}`` (fp16 only) and the
model's tensors are in the 16-bit type. The scheduler's is OptimizerParamScheduler.state_dict
(steps counted in samples); ``rng_state`` a list (one entry per data-parallel rank, one without
--data-parallel-random-init) of python's, numpy's, torch's and CUDA's generator states and the
tensor-parallel tracker's; ``args.consumed_train_samples`` the samples trained.

megart keeps its params in fp32 and autocasts, so its fp32 weights are the master copies. The
optimizer state is written as Megatron's for the same model (megart.training.megatron_optimizer:
its param groups, order and shapes). What megart needs beyond Megatron's keys to resume exactly
(its layout record, the layer ids, its loss scaler and the tracker's CPU streams) rides along
under the extra key ``megart``, which Megatron's loader does not read. A file Megatron-LM wrote
has no such key: its args give the model and layout, its place the layers, and the tracker's
streams (CUDA ones in Megatron) are not taken. Writing is here; reading, in
megart.training.megatron_file_read.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from typing import Any

import numpy as np
import torch

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct

from megart.models import chunk_layers
from megart.models.config import GPTConfig
from megart.models.megatron_names import expert_bias_key, to_megatron
from megart.training import megatron_expert_files as experts
from megart.training import tokenizer_record
from megart.training.dtypes import half_dtype
from megart.training.megatron_args import megatron_args, saved_stages
from megart.training.megatron_layout import OUTPUT, WORD, with_extra_states
from megart.training.megatron_optimizer import (
    in_megatron_order,
    megatron_group_keys,
    to_megatron_optimizer,
)
from megart.training.megatron_scheduler import scheduler_state

CHECKPOINT_VERSION = 3.0
# What torch.load(weights_only=True) must be allowed to rebuild in these files: args, and
# numpy's generator state (a tuple holding a uint32 array).
LOAD_GLOBALS = [argparse.Namespace, np.dtype, np.ndarray, type(np.dtype(np.uint32)), _reconstruct]


def torch_load(path: Any, mmap: bool = False) -> Any:
    """torch.load of a checkpoint file, weights only, allowing LOAD_GLOBALS besides. Only the
    globals not yet allowed are added for the call: torch's safe_globals context removes what
    it was given on exit, even what was allowed before (Megatron-Core allows Namespace at its
    import, and its own loads in this process would then fail)."""
    allowed = torch.serialization.get_safe_globals()
    with torch.serialization.safe_globals([g for g in LOAD_GLOBALS if g not in allowed]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def rank_state(
    args: argparse.Namespace, iteration: int, chunks: list[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """A rank's file with its model chunks under Megatron's keys (``model`` for one chunk,
    ``model0``, ``model1``, ... under interleaving)."""
    state: dict[str, Any] = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
    }
    if len(chunks) == 1:
        state["model"] = chunks[0]
    else:
        state.update({f"model{i}": chunk for i, chunk in enumerate(chunks)})
    return state


def model_chunks(state: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """A rank file's model chunks, in order."""
    if "model" in state:
        return [state["model"]]
    count = sum(1 for k in state if k.startswith("model") and k[5:].isdigit())
    return [state[f"model{i}"] for i in range(count)]


def megatron_layer_ids(a: dict[str, Any], pp_rank: int, chunks: int) -> list[list[int]]:
    """The layers of each model chunk of a Megatron-LM rank file (its ``vars(args)``):
    numbered from 0 in the file, they are Megatron-Core's offset on, uneven stages included."""
    pp = a.get("pipeline_model_parallel_size") or 1
    ranges = chunk_layers(a["num_layers"], pp_rank, pp, chunks, **saved_stages(a))
    return [list(r) for r in ranges]


def is_megatron_file(state: Any) -> bool:
    return isinstance(state, dict) and "checkpoint_version" in state and "args" in state


def training_args(config: Any, cfg: GPTConfig, iteration: int, dp: int) -> argparse.Namespace:
    """megart train's flags under Megatron's names (TrainConfig's fields are Megatron's
    argparse names), over the model's."""
    vpp = config.chunks if config.schedule == "interleaved" else 1
    args = megatron_args(cfg, iteration, config.tp, config.pp, vpp, **config.stages)
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if type(value) is not bool and isinstance(value, int):
            value = int(value)  # plain: megatron_flags.ResolvedVocabulary is an int subclass
        if not hasattr(args, field.name) and isinstance(value, (int, float, str, type(None))):
            setattr(args, field.name, value)
    # Its files' paths absolute, so that the checkpoint's export finds them from elsewhere.
    vars(args).update(tokenizer_record.record(config) or {})
    # The fusion as this run resolved it (TrainConfig's None is Megatron's default).
    args.bias_gelu_fusion = cfg.bias_gelu_fusion
    # Recomputation as Megatron-LM's args hold it: its validate_args turns
    # --recompute-activations into --recompute-granularity selective and deletes the switch;
    # --recompute-modules (nargs "+") is a list of names, None unless given.
    args.recompute_granularity = cfg.recompute_granularity
    vars(args).pop("recompute_activations", None)
    modules = config.recompute_modules
    args.recompute_modules = None if modules is None else list(modules)
    args.data_parallel_size = dp
    args.ckpt_format = "torch"
    return args


def chunk_names_to_megatron(sd: dict[str, torch.Tensor], cfg: GPTConfig, layers: list[int]) -> dict:
    """A model chunk's tensors (megart's names; ``layers`` its layer numbers) under
    Megatron-Core's names and shapes; a later stage's copy of the tied embedding is its
    ``output_layer``."""
    out = to_megatron(sd, cfg)
    if layers[0] != 0 and WORD in out:  # the tied embedding's copy: Megatron's output layer
        out[OUTPUT] = out.pop(WORD)
    return out


def chunk_to_megatron(
    sd: dict[str, torch.Tensor], cfg: GPTConfig, layers: list[int]
) -> dict[str, torch.Tensor | None]:
    last = layers[-1] == cfg.num_layers - 1
    out = with_extra_states(chunk_names_to_megatron(sd, cfg, layers), last)
    return in_megatron_order(out)


def _add_expert_bias(
    model: list[dict[str, Any]], rows: torch.Tensor, layers: list[list[int]], cfg: GPTConfig
) -> None:
    """Each Megatron chunk's MoE layers' expert bias (models.moe_router.expert_bias_rows'
    ``rows``), under the chunk's layer numbers, in fp32 as Megatron-Core saves it."""
    for chunk, ids in zip(model, layers, strict=True):
        for j, layer in enumerate(ids):
            if cfg.is_moe_layer(layer):
                chunk[expert_bias_key(j)] = rows[layer].clone()
    n = cfg.num_layers
    for layer in range(n, n + (cfg.mtp_num_layers or 0)):  # the depths': on the last chunk
        if cfg.is_moe_layer(layer):
            model[-1][expert_bias_key(layer, n)] = rows[layer].clone()


def to_megatron_file(
    state: dict[str, Any], config: Any, cfg: GPTConfig, dp: int, ep_rank: int = 0
) -> dict[str, Any]:
    """megart's file of one rank (megart.training.checkpoint_save.file_state, ``cfg`` its model,
    ``dp`` data-parallel ranks; ``ep_rank`` its expert-parallel rank) in Megatron-LM's legacy
    layout, keeping what megart needs besides under ``megart``. Under expert parallelism its
    experts are numbered locally and its optimizer is a chain of two (megatron_expert_files)."""
    iteration, layers = state["iteration"], state["layer_ids"]
    ep = int(state["config"].get("expert_model_parallel_size") or 1)
    if ep > 1:
        state = experts.shifted(state, -experts.first_expert(ep_rank, ep, cfg.num_experts))
    model = [
        chunk_to_megatron(sd, cfg, ids) for sd, ids in zip(state["model"], layers, strict=True)
    ]
    half = half_dtype(config)
    args = training_args(config, cfg, iteration, dp)
    args.expert_model_parallel_size = ep
    args.consumed_train_samples = state["consumed_train_samples"]  # where Megatron keeps it
    out = rank_state(args, iteration, model)
    optimizer = state["optimizer"]
    if optimizer is not None:
        keys = megatron_group_keys(config.lr, config.min_lr, config.decoupled_rates())
        if ep == 1:
            params = state["optimizer_params"]
            optimizer = _megatron_optimizer(optimizer, params, state, model, cfg, config, keys)
        else:  # Megatron-Core's ChainedOptimizer: the dense parameters', then the experts'
            optimizer = [
                _megatron_optimizer(
                    *experts.part_of_optimizer(optimizer, state["optimizer_params"], part),
                    state,
                    model,
                    cfg,
                    config,
                    [{**k, "is_expert_parallel": part} for k in keys],
                    part,
                )
                for part in (False, True)
            ]
    if half is not None and optimizer is not None:
        for chunk in model:
            chunk.update({k: v.to(half) for k, v in chunk.items() if v is not None})
    bias = state.get("expert_bias")
    if bias is not None:  # after the 16-bit casts: the bias stays fp32
        _add_expert_bias(model, bias, layers, cfg)
    if optimizer is not None:
        out["optimizer"] = optimizer
        consumed = state["consumed_train_samples"]
        out["opt_param_scheduler"] = scheduler_state(config, iteration, consumed)
    rng = state["rng"]
    if rng is not None:
        out["rng_state"] = [
            {
                "random_rng_state": random.getstate(),
                "np_rng_state": np.random.get_state(),
                "torch_rng_state": rng["torch"],
                "cuda_rng_state": rng["cuda"],  # None on a CPU run
                "rng_tracker_states": {
                    n: cpu if cuda is None else cuda for n, (cpu, cuda) in rng["tracker"].items()
                },
            }
        ]
    keep = ("release", "config", "model_config", "layer_ids", "loss_scaler")
    out["megart"] = {k: state[k] for k in keep} | {
        "rng_tracker": None if rng is None else rng["tracker"],
        "half": half is not None and optimizer is not None,
        "optimizer_layout": "megatron",  # earlier files hold megart's optimizer state as is
        "expert_bias": bias,  # every layer's, as megart's own files hold it
    }
    return out


def _megatron_optimizer(
    optimizer: dict[str, Any],
    params: list[tuple[int, str]],
    state: dict[str, Any],
    model: list[dict[str, Any]],
    cfg: GPTConfig,
    config: Any,
    keys: list[dict[str, Any]],
    experts_part: bool | None = None,
) -> dict[str, Any]:
    """Megatron's optimizer state dict of megart's ``optimizer`` (``params`` names its
    parameters) for the Megatron chunks ``model`` (fp32 still): FP32Optimizer's, or
    Float16OptimizerWithFloat16Params' with the fp32 masters. ``experts_part``: under expert
    parallelism, the experts' (True) or the dense parameters' (False) optimizer of the chain."""
    layers = state["layer_ids"]
    megart_model, megatron_model = state["model"], model
    if experts_part is not None:
        megart_model = experts.split_model(megart_model, experts_part, megatron=False)
        megatron_model = experts.split_model(model, experts_part, megatron=True)
    optimizer, groups = to_megatron_optimizer(
        optimizer,
        params,
        megart_model,
        megatron_model,
        lambda c, sd: chunk_names_to_megatron(sd, cfg, layers[c]),
        keys,
    )
    if experts_part:  # the dense part keeps every group: each is filled on some rank
        optimizer, groups = experts.experts_groups_only(optimizer, groups, cfg.bias)
    if half_dtype(config) is None:
        return optimizer
    # The fp32 weights are the master copies; the model holds their 16-bit casts.
    masters = [[model[c][n] for c, n in group] for group in groups]
    out = {"optimizer": optimizer, "fp32_from_fp16_params": masters}
    scaler = state["loss_scaler"]
    if scaler is not None:
        # A static --loss-scale is Megatron-Core's ConstantGradScaler, whose state is {}.
        out["grad_scaler"] = {} if config.loss_scale else to_grad_scaler(scaler, config.hysteresis)
    return out


def to_grad_scaler(scaler: dict[str, Any], hysteresis: int) -> dict[str, Any]:
    """megart's loss scaler state as Megatron-Core's DynamicGradScaler's state dict; a state
    without a tracker (saved before megart had hysteresis) gets a fresh one, ``hysteresis``."""
    return {
        "scale": torch.tensor(float(scaler["scale"])),
        "growth_tracker": int(scaler["good_steps"]),
        "hysteresis_tracker": int(scaler.get("hysteresis_tracker", hysteresis)),
    }


def from_grad_scaler(scaler: dict[str, Any]) -> dict[str, Any]:
    """Megatron-Core's DynamicGradScaler state dict as megart's loss scaler state."""
    return {
        "scale": float(scaler["scale"]),
        "good_steps": int(scaler["growth_tracker"]),
        "hysteresis_tracker": int(scaler["hysteresis_tracker"]),
    }
