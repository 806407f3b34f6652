"""What megart train refuses with --expert-model-parallel-size > 1 (expert parallelism: models.
expert_exchange, training.expert_grads), by name, before any rank waits on another. It runs with
tensor (each expert split over it as Megatron's default --expert-tensor-parallel-size),
context, pipeline and data parallelism (the distributed optimizer included), saving megart's
own checkpoints, Megatron-LM's legacy files (training.megatron_expert_files; with the
distributed optimizer training.megatron_expert_distopt) and its torch_dist stores without the
distributed optimizer (training.megatron_dist_train)."""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.parallel.experts import FLAG, check_expert_parallel
from megart.parallel.layout import make_layout


def check_expert_flags(cfg: Any, dp: int) -> None:
    """Refuses expert parallelism where it cannot run: the layout (parallel.experts) and
    Megatron-LM's checkpoint formats."""
    ep = cfg.expert_model_parallel_size
    if ep == 1:
        return
    world = cfg.tp * cfg.pp * cfg.context_parallel_size * dp
    layout = make_layout(world, cfg.tp, cfg.pp, dp, cp=cfg.context_parallel_size)
    check_expert_parallel(layout, ep, cfg.num_experts)
    if cfg.ckpt_format == "torch_dist" and cfg.use_distributed_optimizer:
        raise ConfigError(
            f"{FLAG} {ep} with --ckpt-format torch_dist and --use-distributed-optimizer: "
            "megart does not write the distributed optimizer's state of spread experts in "
            "Megatron-LM's torch_dist store (Megatron-Core's chain of the dense and the "
            "experts' DistributedOptimizers); use --ckpt-format megart (the default), torch "
            "(Megatron-LM's legacy files, its distrib_optim.pt included), or torch_dist "
            "without the distributed optimizer"
        )
    # --ckpt-format torch is written with or without the distributed optimizer (its chained
    # distrib_optim.pt: training.megatron_expert_distopt).
