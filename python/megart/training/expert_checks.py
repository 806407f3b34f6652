"""What megart train refuses with --expert-model-parallel-size > 1 (expert parallelism: models.
expert_exchange, training.expert_grads), by name, before any rank waits on another. It runs with
tensor (each expert split over it as Megatron's default --expert-tensor-parallel-size),
context, pipeline and data parallelism (the distributed optimizer included), saving megart's
own checkpoints, Megatron-LM's legacy files (training.megatron_expert_files; with the
distributed optimizer training.megatron_expert_distopt) and its torch_dist stores (training.
megatron_dist_train; the distributed optimizer's chain: training.megatron_dist_distopt)."""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.parallel.experts import check_expert_parallel
from megart.parallel.layout import make_layout


def check_expert_flags(cfg: Any, dp: int) -> None:
    """Refuses expert parallelism where it cannot run (the layout: parallel.experts)."""
    ep = cfg.expert_model_parallel_size
    if ep == 1:
        return
    world = cfg.tp * cfg.pp * cfg.context_parallel_size * dp
    layout = make_layout(world, cfg.tp, cfg.pp, dp, cp=cfg.context_parallel_size)
    check_expert_parallel(layout, ep, cfg.num_experts)
    # Megatron-LM's formats are written with or without the distributed optimizer: --ckpt-format
    # torch's chained distrib_optim.pt (training.megatron_expert_distopt), torch_dist's chain
    # of two DistributedOptimizers' buckets (training.megatron_dist_distopt).
    _check_stages_hold_experts(cfg)


def _check_stages_hold_experts(cfg: Any) -> None:
    """Refuses Megatron-LM's formats of the distributed optimizer where a pipeline rank holds
    no MoE layer (--moe-layer-freq): Megatron-Core 0.16.1 gives every rank the param groups of
    all ranks, so that rank's experts' optimizer has one empty group, which megart's files leave
    out (Megatron-Core's load then refuses them: KeyError on the group), and without
    Transformer Engine or Apex its state_dict() cannot take that optimizer's step."""
    from megart.models.stages import chunk_layers

    if not (cfg.use_distributed_optimizer and cfg.ckpt_format in ("torch", "torch_dist")):
        return
    if cfg.save is None:
        return
    model = cfg.gpt_config()
    v_shape = cfg.schedule == "zb-v"  # layer_placement.placement's (which imports this module)
    for rank in range(cfg.pp):
        chunks = chunk_layers(cfg.num_layers, rank, cfg.pp, cfg.chunks, v_shape, **cfg.stages)
        if not any(model.is_moe_layer(layer) for layers in chunks for layer in layers):
            raise ConfigError(
                f"--ckpt-format {cfg.ckpt_format} --use-distributed-optimizer at "
                f"--expert-model-parallel-size {cfg.expert_model_parallel_size}: pipeline rank "
                f"{rank} holds no MoE layer (--moe-layer-freq), whose empty experts' optimizer "
                "megart does not write as Megatron-Core's; save with --ckpt-format megart, or "
                "place a MoE layer on every pipeline rank"
            )
