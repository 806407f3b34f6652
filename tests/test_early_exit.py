"""Megatron's early exits and the NaN check. --exit-interval, --exit-duration-in-mins and
--exit-signal-handler stop every rank after the same iteration, saving first, and the run
resumes on the uninterrupted curve; a gradient norm or loss that is not finite stops every
rank with a TrainingError before the step (no hang, weights untouched), unless
--no-check-for-nan-in-loss-and-grad."""

import math
import os
import signal
import subprocess
import sys

import pytest

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.training import checkpoint


def test_exit_interval_saves_stops_and_resumes_on_the_same_curve(tmp_path):
    layout = dict(pipeline_model_parallel_size=2)
    straight = launch(tw.train_kw, 2, dict(train_iters=5, **layout), timeout=300)[0]
    stopped = launch(
        tw.train_kw,
        2,
        dict(train_iters=5, exit_interval=2, save=str(tmp_path), **layout),
        timeout=300,
    )
    for history in stopped:
        assert [h["iteration"] for h in history] == [1, 2]
        assert history[-1]["exit"] == "--exit-interval 2"
    assert checkpoint.latest_iteration(tmp_path) == 2
    resumed = launch(
        tw.train_kw, 2, dict(train_iters=5, load=str(tmp_path), **layout), timeout=300
    )[0]
    assert [h["iteration"] for h in resumed] == [3, 4, 5]
    assert [h["loss"] for h in stopped[0] + resumed] == pytest.approx(
        [h["loss"] for h in straight], **tw.SAME_RUN
    )


def test_exit_duration_stops_once_the_time_is_up():
    for history in launch(
        tw.train_kw, 2, dict(train_iters=5, exit_duration_in_mins=0.0), timeout=300
    ):
        assert [h["iteration"] for h in history] == [1]
        assert history[0]["exit"].startswith("--exit-duration-in-mins 0.0")


def _sigterm_on_rank_1_after(kw, iteration):
    """Rank 1 receives SIGTERM right after ``iteration``; returns the iterations run."""
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    done = []
    for fig in trainer.iterations():
        done.append((fig["iteration"], fig.get("exit")))
        if fig["iteration"] == iteration and trainer.grid.dp_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    handler = signal.getsignal(signal.SIGTERM)
    return done, handler == signal.SIG_DFL


def test_sigterm_on_one_rank_stops_every_rank_after_the_next_iteration(tmp_path):
    kw = dict(train_iters=6, exit_signal_handler=True, save=str(tmp_path))
    for done, restored in launch(_sigterm_on_rank_1_after, 2, kw, 2, timeout=300):
        # The signal arrives after iteration 2's check: every rank stops after iteration 3.
        assert done == [(1, None), (2, None), (3, "SIGTERM (--exit-signal-handler)")]
        assert restored  # the handler is uninstalled when training ends
    assert checkpoint.latest_iteration(tmp_path) == 3


def _diverging(kw):
    """Poisons one weight on the first pipeline stage after iteration 1; returns what each
    rank saw: the TrainingError's message (or the figures), and whether the weights stayed
    those after iteration 1."""
    import torch

    from megart.errors import TrainingError
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    figures = [trainer.train_step(0)]
    params = [p for c in trainer.chunks for p in c.parameters()]
    if trainer.grid.pp_rank == 0:
        with torch.no_grad():
            trainer.chunks[0].blocks[0].mlp.fc.weight.view(-1)[0] = math.nan
    before = [p.detach().clone() for p in params]
    try:
        figures.append(trainer.train_step(1))
    except TrainingError as e:
        untouched = all(
            torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(params, before, strict=True)
        )
        return str(e), untouched
    return figures, None


def test_a_nan_stops_every_rank_before_the_step():
    kw = dict(pipeline_model_parallel_size=2)
    for message, untouched in launch(_diverging, 4, kw, timeout=300):
        assert isinstance(message, str), message
        assert message.startswith("iteration 2: the gradient norm is nan")
        assert "--no-check-for-nan-in-loss-and-grad" in message
        assert untouched


def test_the_check_can_be_turned_off():
    kw = dict(check_for_nan_in_loss_and_grad=False)
    figures, _ = launch(_diverging, 1, kw, timeout=300)[0]
    assert math.isnan(figures[1]["loss"]) and math.isnan(figures[1]["grad_norm"])


@pytest.mark.parametrize("kw", [dict(exit_interval=0), dict(exit_duration_in_mins=-1.0)])
def test_bad_exit_values_are_refused(kw):
    with pytest.raises(ConfigError, match="--exit-interval .* --exit-duration-in-mins"):
        tw.tiny(**kw).check(1)


def test_megart_train_says_why_it_stopped():
    out = subprocess.run(
        [sys.executable, "-m", "megart", "train", "--train-iters", "4", "--exit-interval", "1"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "exiting after iteration 1: --exit-interval 1" in out
    assert "iteration     2/4" not in out
