"""What megart train refuses with multi-token prediction (--mtp-num-layers, models.mtp): the
layouts and formats its depths are not built or checked for, each named."""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.training.megatron_mtp import refuse_mtp_layout

_WHY = "megart's multi-token prediction is not built for it"


def check_mtp_flags(cfg: Any) -> None:
    """Refuses --mtp-num-layers with what megart's depths do not take (TrainConfig ``cfg``)."""
    if not cfg.mtp_num_layers:
        return
    if cfg.calculate_per_token_loss:
        raise ConfigError(
            f"--mtp-num-layers with --calculate-per-token-loss: {_WHY} (the depths' losses "
            "are means over each microbatch's tokens); leave one of them out"
        )
    if cfg.ckpt_format != "megart":  # Megatron-LM's torch or torch_dist
        refuse_mtp_layout(
            cfg.gpt_config(), cfg.pp * cfg.chunks, cfg.ckpt_format, cfg.use_distributed_optimizer
        )
