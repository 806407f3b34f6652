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
    any but constant     min_lr once n > D (linear and cosine reach it at n = D)

Megatron counts its steps in samples; u is one sample in iterations (1 / global batch), where
its inverse-square-root clamps. With the default --lr-warmup-init 0 the first iteration runs
at rate 0, as Megatron's does: Adam's moments take its gradients, the weights do not move.
"""

from __future__ import annotations

import math

from megart.errors import ConfigError

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


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
) -> float:
    """The rate of the iteration after ``iteration`` iterations (a fraction under
    --rampup-batch-size: the samples consumed in global batches) under ``style`` (one of
    LR_DECAY_STYLES); ``sample`` is one sample in iterations, where inverse-square-root clamps."""
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
    ratio = (iteration - warmup_iters) / (decay_iters - warmup_iters)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)
