"""TrainConfig's learning-rate schedule in iterations, from its flags (Megatron-LM's
--lr-* and --train-samples spellings): kept apart from the config's fields, which it reads."""

from __future__ import annotations

from megart.training.lr import learning_rate


class LearningRateFlags:
    """What megart.training.config.TrainConfig's learning-rate flags mean in iterations: the
    decay, warm-up and WSD anneal lengths, and the rate of each iteration. A mixin of
    properties only; the fields are TrainConfig's."""

    # TrainConfig's fields these read.
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int | None
    lr_decay_samples: int | None
    lr_warmup_fraction: float | None
    lr_warmup_iters: int
    lr_warmup_samples: int
    lr_warmup_init: float
    lr_wsd_decay_style: str
    lr_wsd_decay_iters: int | None
    lr_wsd_decay_samples: int | None
    decoupled_lr: float | None
    decoupled_min_lr: float | None
    train_iters: int | None
    train_samples: int | None
    global_batch_size: int

    @property
    def decay_iters(self) -> float:
        """--lr-decay-iters, or --lr-decay-samples (or --train-samples) in global batches, as
        Megatron's scheduler counts samples; else --train-iters."""
        samples = self.lr_decay_samples or self.train_samples
        if samples is not None:
            return samples / self.global_batch_size
        return self.lr_decay_iters or self.train_iters

    @property
    def warmup_iters(self) -> float:
        """Warm-up iterations: --lr-warmup-iters, or --lr-warmup-fraction of the decay
        iterations (not rounded, as Megatron's), or --lr-warmup-samples' iterations."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * self.decay_iters
        if self.lr_warmup_samples:
            return self.lr_warmup_samples / self.global_batch_size
        return self.lr_warmup_iters

    @property
    def anneal_iters(self) -> float | None:
        """WSD's anneal: --lr-wsd-decay-iters, or --lr-wsd-decay-samples in global batches
        (Megatron's scheduler counts samples); None when neither is given."""
        if self.lr_wsd_decay_samples is not None:
            return self.lr_wsd_decay_samples / self.global_batch_size
        return self.lr_wsd_decay_iters

    def decoupled_rates(self) -> tuple[float, float] | None:
        """--decoupled-lr's peak and floor (the floor --min-lr's unless --decoupled-min-lr);
        None without --decoupled-lr."""
        if self.decoupled_lr is None:
            return None
        floor = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        return self.decoupled_lr, floor

    def learning_rate(
        self, iteration: float, peak: float | None = None, floor: float | None = None
    ) -> float:
        """The rate of the iteration after ``iteration`` (0-based; under --rampup-batch-size
        the samples consumed in global batches: see megart.training.lr) under
        --lr-decay-style; ``peak`` and ``floor`` replace --lr and --min-lr (a param group's own,
        as Megatron-Core's scheduler takes a group's max_lr and min_lr)."""
        return learning_rate(
            iteration,
            self.lr if peak is None else peak,
            self.min_lr if floor is None else floor,
            self.warmup_iters,
            self.decay_iters,
            self.lr_decay_style,
            self.lr_warmup_init,
            1.0 / self.global_batch_size,
            self.anneal_iters,
            self.lr_wsd_decay_style,
        )
