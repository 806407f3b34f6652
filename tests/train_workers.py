"""The trainer on every rank of a launched job, with a tiny GPT and a small slice of the corpus."""

from __future__ import annotations

from megart.training.config import TrainConfig
from megart.training.data import builtin_corpus


def tiny(**kw: object) -> TrainConfig:
    base = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        micro_batch_size=2,
        global_batch_size=8,
        train_iters=3,
        lr=1e-3,
        min_lr=1e-4,
        lr_warmup_iters=1,
        clip_grad=1.0,
    )
    return TrainConfig(**{**base, **kw})


def train(**kw: object) -> list[dict]:
    from megart.training.trainer import Trainer

    trainer = Trainer(tiny(**kw), tokens=builtin_corpus(1 << 16))
    return trainer.train(quiet=True)
