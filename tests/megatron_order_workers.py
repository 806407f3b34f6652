"""A --data-order megatron training run on every rank of a launched test: what each rank's
trainer fed its model (training and validation micro batches), as token arrays."""

from __future__ import annotations


def fed(kw: dict) -> list[tuple[str, int, list, list]]:
    """(split, batch, this rank's micro batch inputs, targets) for every batch the trainer read."""
    import train_workers as tw
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw))
    seen = []
    original = trainer._microbatches

    def recording(data, iteration, size, micro=None):
        inputs, targets, documents = original(data, iteration, size, micro)
        split = "train" if data is trainer.data else "valid" if data is trainer.valid else "test"
        seen.append((split, iteration, [x.tolist() for x in inputs], [y.tolist() for y in targets]))
        return inputs, targets, documents

    trainer._microbatches = recording
    trainer.train(quiet=True)
    return seen


def trained(kw: dict) -> list[dict]:
    """The run's figures: a tiny GPT (tests/train_workers.tiny) on --data-path's data."""
    import train_workers as tw
    from megart.training.trainer import Trainer

    return Trainer(tw.tiny(**kw)).train(quiet=True)


def fed_masked(kw: dict) -> list[tuple[str, int, list, list, list, float | None]]:
    """As ``fed``, for a run with a loss mask: (split, batch, inputs, labels, loss masks, the
    per-token denominator) of this rank's micro batches, for every batch the trainer read."""
    import train_workers as tw
    from megart.training.documents import MaskedTargets
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw))
    seen = []
    original = trainer._microbatches

    def recording(data, iteration, size, micro=None):
        inputs, targets, documents = original(data, iteration, size, micro)
        assert all(isinstance(t, MaskedTargets) for t in targets)
        split = "train" if data is trainer.data else "valid" if data is trainer.valid else "test"
        seen.append((split, iteration, [x.tolist() for x in inputs],
                     [t.labels.tolist() for t in targets], [t.mask.tolist() for t in targets],
                     targets[0].denominator))  # fmt: skip
        return inputs, targets, documents

    trainer._microbatches = recording
    trainer.train(quiet=True)
    return seen
