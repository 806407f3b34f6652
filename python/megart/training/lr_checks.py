"""The checks of a training configuration's learning-rate schedule and weight decay
(megart.training.lr): Megatron-LM's rules, each error naming the flags."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.errors import ConfigError
from megart.training.lr import check_decay_style

if TYPE_CHECKING:
    from megart.training.config import TrainConfig


def _check_weight_decay_flags(cfg: TrainConfig) -> None:
    """Megatron-LM's rules: --start-weight-decay and --end-weight-decay go together, with
    --weight-decay-incr-style linear or cosine (which then replaces --weight-decay)."""
    ends = {"--start-weight-decay": cfg.start_weight_decay,
            "--end-weight-decay": cfg.end_weight_decay}  # fmt: skip
    given = [f"{flag} {v}" for flag, v in ends.items() if v is not None]
    style = cfg.weight_decay_incr_style
    if style == "constant" and given:
        raise ConfigError(
            f"{' and '.join(given)} with --weight-decay-incr-style constant: a constant decay is "
            "--weight-decay; give --weight-decay-incr-style linear or cosine for a rising one "
            "(Megatron-LM refuses them too)"
        )
    if style != "constant" and len(given) < 2:
        missing = " and ".join(flag for flag, v in ends.items() if v is None)
        raise ConfigError(
            f"--weight-decay-incr-style {style} rises from --start-weight-decay to "
            f"--end-weight-decay: give {missing}"
        )
    for text, value in zip(given, (v for v in ends.values() if v is not None), strict=True):
        if not value >= 0:  # NaN too
            raise ConfigError(f"{text}: a weight decay is 0 or more")


def _check_wsd_flags(cfg: TrainConfig) -> None:
    """WSD's anneal length is Megatron-LM's --lr-wsd-decay-iters (--lr-wsd-decay-samples in a
    --train-samples run), which it asserts is given; the anneal's flags under another decay
    style, which Megatron-LM ignores, are refused as the mistake they most likely are."""
    lengths = {"--lr-wsd-decay-iters": cfg.lr_wsd_decay_iters,
               "--lr-wsd-decay-samples": cfg.lr_wsd_decay_samples}  # fmt: skip
    given = [f"{flag} {v}" for flag, v in lengths.items() if v is not None]
    style = cfg.lr_decay_style
    if style != "WSD":
        if cfg.lr_wsd_decay_style != "exponential":  # Megatron's default
            given.append(f"--lr-wsd-decay-style {cfg.lr_wsd_decay_style}")
        if given and not cfg.use_checkpoint_opt_param_scheduler:  # else the saved style rules
            raise ConfigError(
                f"{' and '.join(given)} shape the anneal of --lr-decay-style WSD, and do "
                f"nothing under --lr-decay-style {style}: give --lr-decay-style WSD, or leave "
                "them out"
            )
        return
    if not given:
        unit = "samples" if cfg.train_samples is not None else "iters"
        raise ConfigError(
            f"--lr-decay-style WSD anneals the rate over the last part of the decay: give its "
            f"length, --lr-wsd-decay-{unit} (Megatron-LM asserts it is given too)"
        )
    for text, value in zip(given, (v for v in lengths.values() if v is not None), strict=True):
        if value < 0:
            raise ConfigError(f"{text}: an anneal lasts 0 or more")


def check_lr_flags(cfg: TrainConfig) -> None:
    """Refuses learning-rate and weight-decay flags Megatron-LM refuses or ignores, naming
    them and saying what would run."""
    check_decay_style(cfg.lr_decay_style)
    _check_wsd_flags(cfg)
    _check_weight_decay_flags(cfg)
    fraction, iters = cfg.lr_warmup_fraction, cfg.lr_warmup_iters
    if fraction is not None and iters:
        raise ConfigError(
            f"--lr-warmup-fraction {fraction} and --lr-warmup-iters {iters} exclude each "
            "other (as in Megatron-LM); give one of them"
        )
    if fraction is not None and not 0 <= fraction < 1:
        raise ConfigError(
            f"--lr-warmup-fraction {fraction} must be at least 0 and below 1 (a fraction of "
            f"the {cfg.decay_iters} decay iterations)"
        )
    if iters < 0:
        raise ConfigError(f"--lr-warmup-iters {iters} must be at least 0")
    # Megatron-Core's OptimizerParamScheduler asserts 0 <= min_lr <= lr and init_lr <= lr.
    if not 0 <= cfg.min_lr <= cfg.lr or cfg.lr_warmup_init > cfg.lr:
        raise ConfigError(
            f"--min-lr {cfg.min_lr}, --lr-warmup-init {cfg.lr_warmup_init} and --lr {cfg.lr}: "
            "the rate decays from --lr down to --min-lr (Megatron-LM's default 0) and warms "
            "up from --lr-warmup-init (default 0), so give 0 <= --min-lr <= --lr and "
            "--lr-warmup-init <= --lr"
        )
