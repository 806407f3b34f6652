"""Learning-rate schedule: linear warm-up, then a decay to a floor (Megatron's --lr, --min-lr,
--lr-warmup-iters, --lr-warmup-fraction, --lr-decay-iters, --lr-decay-style).

The rate is Megatron-LM's OptimizerParamScheduler.get_lr, with its step count n equal to the
iterations done before this one (megart's 0-based iteration i; under --rampup-batch-size the
samples consumed, in global batches), W warm-up and D decay iterations, lr0 = --lr-warmup-init:

    warm-up (n <= W)     lr0 + (lr - lr0) n / W       (lr0 at the first iteration, lr at n = W)
    constant             lr (for ever, past D too)
    linear               min_lr + (lr - min_lr) (1 - r),              r = (n - W) / (D - W)
    cosine               min_lr + (lr - min_lr) (1 + cos(pi r)) / 2
    inverse-square-root  max(min_lr, lr sqrt(max(W, u) / max(n, u)))
    WSD                  lr until n = D - A, then min_lr + (lr - min_lr) c(a), a = (n - D + A) / A
    any but constant     min_lr once n > D (linear and cosine reach it at n = D)

WSD (warm-up, stable, decay) anneals over the last A iterations of the decay (--lr-wsd-decay-iters,
or --lr-wsd-decay-samples) by --lr-wsd-decay-style's c: exponential 2 (1/2)^a - 1, linear 1 - a,
cosine (1 + cos(pi a)) / 2, minus_sqrt 1 - sqrt(a); each falls from 1 to 0 as a goes 0 to 1.

Megatron counts its steps in samples; u is one sample in iterations (1 / global batch), where
its inverse-square-root clamps. With the default --lr-warmup-init 0 the first iteration runs
at rate 0, as Megatron's does: Adam's moments take its gradients, the weights do not move.
"""

from __future__ import annotations

import math
from typing import Any

from megart.errors import ConfigError

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# WSD's anneal coefficient at the share a of the anneal done (Megatron-Core's get_lr).
_ANNEALS = {
    "exponential": lambda a: 2.0 * 0.5**a - 1.0,
    "linear": lambda a: 1.0 - a,
    "cosine": lambda a: 0.5 * (1.0 + math.cos(math.pi * a)),
    "minus_sqrt": lambda a: 1.0 - math.sqrt(a),
}


def check_decay_style(style: str) -> None:
    if style not in LR_DECAY_STYLES:
        raise ConfigError(f"--lr-decay-style {style!r}; use one of {', '.join(LR_DECAY_STYLES)}")


def learning_rate(
    iteration: float,
    lr: float,
    min_lr: float,
    warmup_iters: float,
    decay_iters: float,
    style: str = "cosine",
    warmup_init: float = 0.0,
    sample: float = 1.0,
    anneal_iters: float | None = None,
    anneal_style: str = "exponential",
) -> float:
    """The rate of the iteration after ``iteration`` iterations (a fraction under
    --rampup-batch-size: the samples consumed in global batches) under ``style`` (one of
    LR_DECAY_STYLES); ``sample`` is one sample in iterations, where inverse-square-root clamps;
    WSD anneals over the last ``anneal_iters`` of the decay by ``anneal_style``."""
    check_decay_style(style)
    if warmup_iters > 0 and iteration <= warmup_iters:
        return warmup_init + (lr - warmup_init) * iteration / warmup_iters
    if style == "constant":
        return lr
    if iteration > decay_iters:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * math.sqrt(max(warmup_iters, sample) / max(iteration, sample)))
    if decay_iters <= warmup_iters:
        # No decay phase (Megatron refuses W >= D; a one-iteration run has it): iteration is
        # then D, the end of the decay.
        return min_lr
    if style == "WSD":
        if anneal_iters is None:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples)")
        start = decay_iters - anneal_iters
        share = 0.0 if iteration <= start else (iteration - start) / anneal_iters
        return min_lr + _ANNEALS[anneal_style](share) * (lr - min_lr)
    ratio = (iteration - warmup_iters) / (decay_iters - warmup_iters)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)


def weight_decay(
    iteration: float, start: float, end: float, style: str, increase_iters: float
) -> float:
    """Megatron-LM's weight decay of the iteration after ``iteration`` iterations (its
    OptimizerParamScheduler.get_wd, --start-weight-decay to --end-weight-decay over the whole
    run, ``increase_iters`` iterations, under --weight-decay-incr-style): linear, or cosine's
    0.5 (cos(pi (1 - r)) + 1) of the rise, r the share of the run done; ``end`` past it."""
    if iteration > increase_iters or style == "constant":
        return end
    ratio = iteration / increase_iters
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


def weight_decay_rate(config: Any, iteration: float) -> float:
    """A TrainConfig's weight decay of its decayed groups for the iteration after
    ``iteration`` (counted as learning_rate counts): --weight-decay, or under
    --weight-decay-incr-style linear or cosine the rise from --start-weight-decay to
    --end-weight-decay over the run (--train-iters, or --train-samples in global batches)."""
    c = config
    if c.weight_decay_incr_style == "constant":
        return c.weight_decay
    run = c.train_samples / c.global_batch_size if c.train_samples is not None else c.train_iters
    start, end = c.start_weight_decay, c.end_weight_decay
    return weight_decay(iteration, start, end, c.weight_decay_incr_style, run)
