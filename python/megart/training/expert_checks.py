"""What megart train refuses with --expert-model-parallel-size > 1 (expert parallelism: models.
expert_exchange, training.expert_grads), by name, before any rank waits on another. This first
slice runs at tensor- and context-parallel size 1, with pipeline and data parallelism, saving
megart's own checkpoints."""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.parallel.experts import FLAG, check_expert_parallel
from megart.parallel.layout import make_layout


def check_expert_flags(cfg: Any, dp: int) -> None:
    """Refuses expert parallelism where it cannot run: the layout (parallel.experts), the
    distributed optimizer, the logged parameter norm and zero count, and Megatron-LM's
    checkpoint formats."""
    ep = cfg.expert_model_parallel_size
    if ep == 1:
        return
    world = cfg.tp * cfg.pp * cfg.context_parallel_size * dp
    layout = make_layout(world, cfg.tp, cfg.pp, dp, cp=cfg.context_parallel_size)
    check_expert_parallel(layout, ep, cfg.num_experts)
    if cfg.use_distributed_optimizer:
        raise ConfigError(
            f"{FLAG} {ep} with --use-distributed-optimizer: megart's distributed optimizer "
            "shards one set of gradient buckets over data parallelism, and the experts' "
            "average over their expert-data-parallel ranks instead; leave one of them out"
        )
    logs = [f for f in ("log_params_norm", "log_num_zeros_in_grad") if getattr(cfg, f, False)]
    if logs:  # their sums count each parameter once over the model-parallel ranks only
        flags = " and ".join("--" + f.replace("_", "-") for f in logs)
        raise ConfigError(
            f"{FLAG} {ep} with {flags}: megart does not count the experts spread over "
            "expert-parallel ranks in those figures yet; leave them out"
        )
    if cfg.ckpt_format != "megart":
        raise ConfigError(
            f"{FLAG} {ep} with --ckpt-format {cfg.ckpt_format}: Megatron-LM's checkpoint "
            "formats of spread experts are not written by megart; use --ckpt-format megart "
            "(the default)"
        )
