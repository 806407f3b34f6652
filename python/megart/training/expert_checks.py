"""What megart train refuses with --expert-model-parallel-size > 1 (expert parallelism: models.
expert_exchange, training.expert_grads), by name, before any rank waits on another. It runs with
tensor (each expert split over it as Megatron's default --expert-tensor-parallel-size),
context, pipeline and data parallelism (the distributed optimizer included), saving megart's
own checkpoints, Megatron-LM's legacy files (training.megatron_expert_files; with the
distributed optimizer training.megatron_expert_distopt) and its torch_dist stores (training.
megatron_dist_train; the distributed optimizer's chain: training.megatron_dist_distopt)."""

from __future__ import annotations

from typing import Any

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
