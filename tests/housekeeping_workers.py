"""Launched runs of the Trainer that record what megart.training.housekeeping did: when the
garbage collector ran and whether it was on, when CUDA's cache was emptied."""

from __future__ import annotations

import gc

import train_workers as tw
from megart.training import housekeeping
from megart.training.data import builtin_corpus
from megart.training.trainer import Trainer


def chores(kw: dict) -> dict:
    """Trains ``kw`` (evaluating with eval_iters), recording each gc.collect and each cache
    emptying between the loop's points; the Trainer's device is the CPU, so emptying is
    counted where it would reach torch.cuda.empty_cache on a GPU."""
    events: list[str] = []
    collect = gc.collect

    def counting_collect(generation: int = 2) -> int:
        events.append(f"gc{generation}")
        return collect(generation)

    gc.collect = counting_collect
    housekeeping.Housekeeping._empty_cache = lambda self: events.append("empty")
    try:
        trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
        enabled_during = []
        for fig in trainer.iterations():
            enabled_during.append(gc.isenabled())
            events.append(
                f"iteration {fig['iteration']}" + (" eval" if "valid_loss" in fig else "")
            )
    finally:
        gc.collect = collect
    return dict(events=events, enabled_during=enabled_during, enabled_after=gc.isenabled())
