"""Launched functions for test_batch_rampup: a ramp-up run's figures and gradients per
iteration, and the one-process reference of each iteration on its whole global batch."""

from __future__ import annotations

import train_workers as tw


def steps_with_grads(kw: dict) -> list[dict]:
    """Trains iteration by iteration; each iteration's figures and every gradient this rank
    holds after it (by place, see train_workers.by_place)."""
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    out = []
    for it in range(trainer.config.train_iters):
        figures = trainer.train_step(it)
        out.append({"figures": figures, "grads": tw.by_place(trainer, lambda p: p.grad)})
    return out


def whole_batch_reference(kw: dict) -> list[dict]:
    """One process: before each iteration of the ramp, the loss and gradients of a plain GPT
    holding the trainer's weights on that iteration's whole global batch at once (one
    forward, no microbatches, no pipeline); then the trainer's iteration."""
    from megart.models import GPT
    from megart.training import batch_rampup
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    c, vocab = trainer.config, trainer.model_config.vocab_size
    out = []
    for it in range(c.train_iters):
        model = GPT(trainer.model_config)
        model.chunk.load_state_dict(trainer.chunks[0].state_dict())
        size = batch_rampup.batch_size(c, trainer.consumed)
        inputs, targets = trainer.data.global_batch(c.seed, it, size)
        loss = model(inputs, targets)
        loss.backward()
        grads = {
            "chunk." + name: (p.grad[:vocab] if name == "wte.weight" else p.grad).clone()
            for name, p in model.chunk.named_parameters()
        }
        out.append({"size": size, "loss": loss.item(), "grads": grads})
        out[-1]["figures"] = trainer.train_step(it)
        out[-1]["trainer_grads"] = tw.by_place(trainer, lambda p: p.grad)
    return out
