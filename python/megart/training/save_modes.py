"""Megatron-LM's two ways of saving besides its persistent, synchronous checkpoints: their
flags' checks (where non-persistent checkpoints live: megart.training.checkpoint_dirs).

Non-persistent checkpoints (--non-persistent-save-interval N --non-persistent-ckpt-type global),
as megatron/training/checkpointing.py has them: every N iterations where no persistent one is
due, a whole checkpoint in --non-persistent-global-ckpt-dir (default ``<save>/non_persistent``),
in --ckpt-format's layout with its own tracker file; before each, every one there but the
newest is deleted (so at most the newest and the one being written are on disk); --load resumes
from the non-persistent directory (``<load>/non_persistent`` by default) when its tracker names
an iteration at least the persistent one's. --ckpt-step picks a persistent checkpoint and
ignores them (Megatron would still prefer a newer non-persistent one). Megatron's ``local``
type (each rank's files on its own disk, nvidia-resiliency-ext's) and ``in_memory`` are refused.

--async-save (torch_dist only, as in Megatron-LM): megart.training.async_save.
"""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError

NON_PERSISTENT_TYPES = ("global", "local", "in_memory")  # Megatron-LM's choices


def check_save_modes(cfg: Any) -> None:
    """Refuses, by name, what megart (or Megatron-LM) cannot do of the two modes."""
    interval, kind = cfg.non_persistent_save_interval, cfg.non_persistent_ckpt_type
    if kind in ("local", "in_memory"):
        raise ConfigError(
            f"--non-persistent-ckpt-type {kind}: megart writes non-persistent checkpoints as "
            "whole checkpoints in one directory (Megatron-LM's global type), not on each "
            "rank's own disk (nvidia-resiliency-ext's local checkpoints); use global"
        )
    if interval is not None:
        if interval < 1:
            raise ConfigError(f"--non-persistent-save-interval {interval} must be at least 1")
        if kind is None:
            raise ConfigError(
                f"--non-persistent-save-interval {interval} needs --non-persistent-ckpt-type "
                "global (Megatron-LM fails at the first such save without it)"
            )
        if not cfg.save:
            raise ConfigError(
                "--non-persistent-save-interval saves beside --save's checkpoints: give --save "
                "(Megatron-LM skips them without; megart refuses rather than skip them)"
            )
        if cfg.ckpt_format == "torch":
            raise ConfigError(
                "--non-persistent-save-interval with --ckpt-format torch: Megatron-LM writes "
                "non-persistent checkpoints in its distributed format only; use --ckpt-format "
                "torch_dist (or megart)"
            )
    if cfg.non_persistent_global_ckpt_dir and kind != "global":
        raise ConfigError(
            "--non-persistent-global-ckpt-dir is where --non-persistent-ckpt-type global saves "
            "and loads: add that type (Megatron-LM ignores the directory without; megart "
            "refuses rather than ignore it)"
        )
    if cfg.async_save:
        if cfg.ckpt_format != "torch_dist":
            raise ConfigError(
                f"--async-save with --ckpt-format {cfg.ckpt_format}: as in Megatron-LM, only "
                "torch_dist checkpoints are written in the background; add --ckpt-format "
                "torch_dist or leave --async-save out"
            )
        if not cfg.save:
            raise ConfigError(
                "--async-save writes --save's checkpoints in the background: give --save "
                "(megart refuses rather than ignore it)"
            )
