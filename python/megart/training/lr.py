"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (Megatron's
--lr, --min-lr, --lr-warmup-iters, --lr-decay-iters)."""

from __future__ import annotations

import math


def learning_rate(
    iteration: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int
) -> float:
    """The rate for ``iteration`` (0-based): lr * (i+1)/warmup during warm-up, then a cosine
    from lr down to min_lr at ``decay_iters``, then min_lr."""
    if warmup_iters > 0 and iteration < warmup_iters:
        return lr * (iteration + 1) / warmup_iters
    if iteration >= decay_iters:
        return min_lr
    progress = (iteration - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
