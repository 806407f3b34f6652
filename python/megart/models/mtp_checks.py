"""GPTConfig's multi-token prediction fields (Megatron's --mtp-num-layers and
--mtp-loss-scaling-factor; the depths are megart.models.mtp's): what megart refuses with them,
kept apart from the config, which calls these."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.errors import ConfigError

if TYPE_CHECKING:
    from megart.models.config import GPTConfig


def check_mtp(cfg: GPTConfig) -> None:
    """Refuses MTP fields megart cannot honour, naming the flags."""
    depths = cfg.mtp_num_layers
    if depths is None:
        return
    if depths < 1:
        raise ConfigError(
            f"--mtp-num-layers {depths}: give 1 or more depths, or leave it out for none"
        )
    full = cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform"
    if full and cfg.recompute_num_layers != 1:
        raise ConfigError(
            f"--mtp-num-layers with --recompute-method uniform --recompute-num-layers "
            f"{cfg.recompute_num_layers}: Megatron-Core recomputes each prediction depth on its "
            "own and refuses any other number there; use --recompute-num-layers 1 (or "
            "--recompute-method block, under which the depths are not recomputed)"
        )
    if cfg.window_size is not None:
        raise ConfigError(
            "--mtp-num-layers with --window-size: megart does not give the prediction depths' "
            "layers a window (leave one of them out)"
        )


def mtp_layout_problems(cfg: GPTConfig, pp: int, chunks: int) -> list[str]:
    """What keeps multi-token prediction from this pipeline layout (for
    GPTConfig.check_layout): with learned positions the last stage would need its own copy
    of the position table, which megart keeps on the first stage only."""
    if cfg.mtp_num_layers and cfg.position_embedding == "learned" and pp * chunks > 1:
        return [
            "--mtp-num-layers with learned absolute positions needs the whole model in one "
            f"pipeline chunk (not {pp} stages x {chunks} chunks): use rotary positions "
            "(--position-embedding-type rope) to pipeline it"
        ]
    return []


def refuse_mtp(depths: int | None, where: str) -> None:
    """Refuses multi-token prediction's ``depths`` (--mtp-num-layers; None or 0: none) for
    ``where`` (a checkpoint format megart does not write or read the depths in)."""
    if depths:
        raise ConfigError(
            f"a model with multi-token prediction (--mtp-num-layers {depths}): megart does not "
            f"write or read its depths' weights in {where}; keep it in megart's own checkpoint "
            "format (--ckpt-format megart)"
        )
