"""Launched functions for test_megatron_flags: megart train's command line in a process, and
the distributed optimizer's deferred all-gathers."""

from __future__ import annotations

import contextlib
import io


def run_cli(argv: list[str]) -> tuple[int, str]:
    """megart train ``argv``: its exit status and what it printed."""
    from megart.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            status = main(["train", *argv])
        except SystemExit as e:  # argparse's refusal of a flag it does not know
            status = e.code
    return status, out.getvalue()


def pending_gathers(kw: dict) -> dict:
    """Three iterations with --overlap-param-gather: their losses, the buckets, the
    all-gathers still running after the first step, and after an evaluation's forward."""
    import train_workers as tw
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    losses = [trainer.train_step(0)["loss"]]
    after_step = len(trainer.optimizer._gathers)
    losses += [trainer.train_step(i)["loss"] for i in (1, 2)]  # each forward waits for them
    trainer.evaluate()  # forwards only: every bucket waited for
    return dict(
        losses=losses,
        buckets=len(trainer.buckets.buckets),
        after_step=after_step,
        after_forward=len(trainer.optimizer._gathers),
    )


def megatron_scheduler(lr, min_lr, w, d, style, init=0.0, anneal=None, anneal_style=None):
    """Megatron-Core's OptimizerParamScheduler (warm-up ``w``, decay ``d`` steps, warm-up from
    ``init``; WSD's anneal over the last ``anneal`` steps by ``anneal_style``), the independent
    reference for learning rates; returns it and a function giving its current rate."""
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    groups = [{}]
    scheduler = OptimizerParamScheduler(
        SimpleNamespace(param_groups=groups), init, lr, min_lr, w, d, style, 0.0, 0.0, 1,
        "constant", wsd_decay_steps=anneal, lr_wsd_decay_style=anneal_style,
    )  # fmt: skip
    return scheduler, lambda: scheduler.get_lr(groups[0])


def megatron_rate(i, lr, min_lr, w, d, style, init=0.0, anneal=None, anneal_style=None):
    """Megatron-Core's rate after ``i`` steps (see megatron_scheduler)."""
    scheduler, rate = megatron_scheduler(lr, min_lr, w, d, style, init, anneal, anneal_style)
    scheduler.step(i)
    return rate()
