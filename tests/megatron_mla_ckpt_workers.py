"""Launched workers of test_megatron_mla_ckpt: what Megatron-Core 0.16.1's GPTModel with
multi-latent attention (local spec, megatron_core_workers) says about its own checkpoint
layout at the world's tensor-parallel size."""

from __future__ import annotations

import os

import torch

import megatron_core_workers as mcw
from megart.models import GPTConfig


def megatron_layout(kw: dict) -> dict:
    """On each launched rank (tensor-parallel ranks): Megatron-Core's GPTModel of
    ``GPTConfig(**kw)``: its state dict's names in order (tensors' shapes; None for an
    ``_extra_state``) and its sharded state dict's tensors, each as (key, global shape, the
    axes split over ranks, this rank's offsets), ``_extra_state`` objects as their keys."""
    from megatron.core import parallel_state

    tp = int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    mcw.on_cpu_only()
    model = mcw.megatron_model(GPTConfig(**kw), tp)
    state = {k: None if v is None else tuple(v.shape) for k, v in model.state_dict().items()}
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    sharded, objects = {}, set()
    for name, v in model.sharded_state_dict().items():
        if isinstance(v, ShardedObject):  # an extra state
            objects.add(v.unique_key)
            continue
        if isinstance(v, ShardedTensorFactory):  # SwiGLU's fc1: its gate's piece tells
            v = next(iter(_tensors(v.build())))
        split = tuple(i for i, n in enumerate(v.axis_fragmentations) if n > 1)
        sharded[name] = (v.key, tuple(v.global_shape), split, tuple(v.global_offset))
    torch.distributed.destroy_process_group()
    return {"state": state, "sharded": sharded, "objects": objects}


def _tensors(built):
    """The sharded tensors a factory built (one, or a list or dict of them)."""
    if isinstance(built, dict):
        return built.values()
    return built if isinstance(built, (list, tuple)) else [built]
