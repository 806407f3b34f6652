"""The learning-rate scheduler's state in Megatron-LM's legacy checkpoint
(``opt_param_scheduler``): what megart writes, and the check Megatron makes on load.

Megatron-Core's OptimizerParamScheduler counts its steps in samples (it steps by the global
batch each iteration); Megatron-LM builds it from the flags (get_optimizer_param_scheduler) and,
by default, its load_state_dict asserts that each saved value equals the one the flags give.
"""

from __future__ import annotations

import math
from typing import Any

from megart.errors import ConfigError


def scheduler_state(config: Any, iteration: int, consumed: int | None = None) -> dict[str, Any]:
    """Megatron's OptimizerParamScheduler.state_dict after ``iteration`` iterations that
    consumed ``consumed`` samples (by default iterations x --global-batch-size), its values as
    Megatron-LM's get_optimizer_param_scheduler computes them from the flags."""
    gbs = config.global_batch_size
    decay = round(config.decay_iters * gbs)
    constant = config.weight_decay_incr_style == "constant"
    fraction = config.lr_warmup_fraction
    return {
        "max_lr": config.lr,
        # Megatron does not round a fraction's warm-up.
        "lr_warmup_steps": fraction * decay
        if fraction is not None
        else round(config.warmup_iters * gbs),
        "num_steps": iteration * gbs if consumed is None else consumed,
        "lr_decay_style": config.lr_decay_style,
        "lr_decay_steps": decay,
        "min_lr": config.min_lr,
        # Megatron's validate_args sets both ends to --weight-decay for a constant decay.
        "start_wd": config.weight_decay if constant else config.start_weight_decay,
        "end_wd": config.weight_decay if constant else config.end_weight_decay,
        "wd_incr_style": config.weight_decay_incr_style,
        "wd_incr_steps": config.train_iters * gbs
        if config.train_samples is None
        else config.train_samples,
    }


# Each value Megatron's OptimizerParamScheduler.load_state_dict checks (under its current or
# older key), and the flags of this run that give it.
_SCHEDULER_FLAGS = {
    "max_lr": (("start_lr", "max_lr"), "--lr"),
    "min_lr": (("min_lr",), "--min-lr"),
    "lr_warmup_steps": (("warmup_iter", "warmup_steps", "lr_warmup_steps"),
                        "--lr-warmup-iters (or --lr-warmup-samples, --lr-warmup-fraction)"),
    "lr_decay_steps": (("end_iter", "decay_steps", "lr_decay_steps"),
                       "--lr-decay-iters (or --lr-decay-samples; by default --train-iters)"),
    "lr_decay_style": (("decay_style", "lr_decay_style"), "--lr-decay-style"),
    "start_wd": (("start_wd",), "--weight-decay (or --start-weight-decay)"),
    "end_wd": (("end_wd",), "--weight-decay (or --end-weight-decay)"),
    "wd_incr_steps": (("wd_incr_steps",), "--train-iters (or --train-samples)"),
    "wd_incr_style": (("wd_incr_style",), "--weight-decay-incr-style"),
}  # fmt: skip


def saved_value(saved: dict[str, Any], key: str) -> Any:
    """The value of ``key`` (scheduler_state's name) in Megatron's saved scheduler state, under
    its current or an older name; None where it was saved before Megatron kept it."""
    return next((saved[n] for n in _SCHEDULER_FLAGS[key][0] if n in saved), None)


def check_scheduler(saved: dict[str, Any], config: Any, directory: Any) -> None:
    """Refuses to resume Megatron's scheduler ``saved`` under flags that give other values, as
    its load_state_dict does by default, naming the flag; with --override-opt_param-scheduler
    the flags' schedule is taken, as Megatron's override takes it, and with
    --use-checkpoint-opt_param-scheduler the flags were made the saved schedule's
    (megart.training.checkpoint_scheduler; what it does not set, such as the weight decay's
    steps of a constant decay, changes no rate)."""
    if config.override_opt_param_scheduler or config.use_checkpoint_opt_param_scheduler:
        return
    now = scheduler_state(config, 0)
    for key, (_, flag) in _SCHEDULER_FLAGS.items():
        was = saved_value(saved, key)
        if was is None:
            continue  # saved before Megatron kept it
        same = (
            was == now[key] if isinstance(was, str) else math.isclose(was, now[key], rel_tol=1e-9)
        )
        if not same:
            raise ConfigError(
                f"--load {directory}: Megatron-LM's scheduler state was saved with {key} {was} "
                f"and this run's flags give {now[key]}; set {flag} as the run that wrote it "
                "did, or give --override-opt_param-scheduler to follow this run's flags (as "
                "Megatron-LM)"
            )
