"""Learning-rate schedule: linear warm-up, then a decay to a floor (Megatron's --lr, --min-lr,
--lr-warmup-iters, --lr-warmup-fraction, --lr-decay-iters, --lr-decay-style).

After warm-up the rate follows Megatron-LM's OptimizerParamScheduler, with its step count n
equal to the iterations done (megart's 0-based iteration i), W warm-up and D decay iterations:

    constant             lr (for ever, past D too)
    linear               min_lr + (lr - min_lr) (1 - r),              r = (n - W) / (D - W)
    cosine               min_lr + (lr - min_lr) (1 + cos(pi r)) / 2
    inverse-square-root  max(min_lr, lr sqrt(max(W, 1) / max(n, 1)))
    any but constant     min_lr once n > D (linear and cosine reach it at n = D)

Warm-up is megart's own and differs from Megatron's by one iteration: iteration i (0-based)
runs at lr (i+1)/W, reaching lr on the W-th iteration, where Megatron runs at lr i/W (from
--lr-warmup-init, 0: its first iteration does not move the weights) and reaches lr on the
(W+1)-th. From iteration W on the two agree. Kept because the default run's recorded figures
depend on it. A fractional W (from --lr-warmup-fraction) caps the last warm-up step at lr.
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
    step: float = 1.0,
) -> float:
    """The rate for ``iteration`` (0-based) under ``style`` (one of LR_DECAY_STYLES).

    Under --rampup-batch-size ``iteration`` is the samples consumed before this iteration in
    global batches (a fraction) and ``step`` this iteration's batch in global batches, so the
    schedule follows consumed samples as Megatron's counts them; otherwise both are whole."""
    check_decay_style(style)
    if warmup_iters > 0 and iteration < warmup_iters:
        if iteration + step > warmup_iters:
            return lr  # the partial last step of a fractional warm-up (--lr-warmup-fraction)
        return lr * (iteration + step) / warmup_iters
    if style == "constant":
        return lr
    if iteration > decay_iters:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, lr * math.sqrt(max(warmup_iters, 1) / max(iteration, 1)))
    if decay_iters <= warmup_iters:
        # No decay phase (Megatron refuses W >= D; a one-iteration run has it): iteration is
        # then D, the end of the decay.
        return min_lr
    ratio = (iteration - warmup_iters) / (decay_iters - warmup_iters)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * ratio))
    return min_lr + coeff * (lr - min_lr)
