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
    pieces each of the tensor's own axes is cut in, whether it is SwiGLU's [gate; up] cut in
    halves too), ``_extra_state`` objects as their keys."""
    from megatron.core import parallel_state

    tp = int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    mcw.on_cpu_only()
    cfg = GPTConfig(**kw)
    if cfg.num_experts is not None:
        mcw.layer_spec = _block_spec_with_mla_shims(mcw.layer_spec)
    model = mcw.megatron_model(cfg, tp)
    state = {k: None if v is None else tuple(v.shape) for k, v in model.state_dict().items()}
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    sharded, objects = {}, set()
    for name, v in model.sharded_state_dict().items():
        if isinstance(v, ShardedObject):  # an extra state
            objects.add(v.unique_key)
            continue
        halves = isinstance(v, ShardedTensorFactory)
        if halves:  # SwiGLU's fc1: its gate's piece (of 2 tp on its rows) tells
            v = next(iter(_tensors(v.build())))
        # How many pieces the tensor's own axes are cut in (after its layer's and expert's).
        own = tuple(v.axis_fragmentations[v.prepend_axis_num :])
        sharded[name] = (v.key, tuple(v.global_shape), own, halves)
    torch.distributed.destroy_process_group()
    return {"state": state, "sharded": sharded, "objects": objects}


def _tensors(built):
    """The sharded tensors a factory built (one, or a list or dict of them)."""
    if isinstance(built, dict):
        return built.values()
    return built if isinstance(built, (list, tuple)) else [built]


def _block_spec_with_mla_shims(layer_spec):
    """megatron_core_workers.layer_spec, whose decoder block spec (a model with experts) gets
    the two MLA shims its single layer spec has (_widths_dropped's core attention; no
    Transformer Engine) in each layer's spec."""

    def spec(cfg, config, vp_stage):
        out = layer_spec(cfg, config, vp_stage)
        if cfg.num_experts is None or not cfg.multi_latent_attention:
            return out
        from megatron.core.transformer import multi_latent_attention as mla

        mla.HAVE_TE = False
        for layer in out.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = mcw._widths_dropped()
        return out

    return spec
