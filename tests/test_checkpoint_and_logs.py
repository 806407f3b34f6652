"""Checkpoints and TensorBoard logs. A resumed run continues the same loss curve (one process
and tp2 x pp2), files follow Megatron-LM's layout, a crash mid-save leaves the last good
checkpoint, loading a checkpoint of another model or from an empty directory is refused with
what to change (another layout is resharded: test_checkpoint_reshard); TensorBoard's own
reader finds the iteration figures."""

import pytest

import train_workers as tw
from megart import ConfigError
from megart.launcher import LaunchError, launch
from megart.training import checkpoint

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)  # random streams must resume too


def _resumed_equals_straight(tmp_path, nproc, layout):
    straight = launch(tw.train_kw, nproc, dict(train_iters=5, **DROPOUT, **layout), timeout=300)
    first = launch(
        tw.train_kw,
        nproc,
        dict(train_iters=2, save=str(tmp_path), **DROPOUT, **layout),
        timeout=300,
    )
    resumed = launch(
        tw.train_kw,
        nproc,
        dict(train_iters=5, load=str(tmp_path), **DROPOUT, **layout),
        timeout=300,
    )
    for s, f, r in zip(straight, first, resumed, strict=True):
        assert [h["iteration"] for h in f] == [1, 2]
        assert [h["iteration"] for h in r] == [3, 4, 5]
        for a, b in zip(s, f + r, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], **tw.SAME_RUN)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], **tw.SAME_RUN)


def test_resume_continues_the_same_loss_curve(tmp_path):
    _resumed_equals_straight(tmp_path, 1, {})
    assert checkpoint.latest_iteration(tmp_path) == 2  # the resumed run had no --save
    assert (tmp_path / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").exists()


def test_resume_under_tensor_and_pipeline_parallelism(tmp_path):
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    _resumed_equals_straight(tmp_path, 4, layout)
    names = sorted(p.name for p in (tmp_path / "iter_0000002").iterdir())
    assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]


def test_save_interval_writes_every_interval_and_the_end(tmp_path):
    launch(tw.train_kw, 1, dict(train_iters=5, save=str(tmp_path), save_interval=2), timeout=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000005",
        checkpoint.TRACKER,
    ]
    assert checkpoint.latest_iteration(tmp_path) == 5


def test_a_crash_mid_save_leaves_the_last_good_checkpoint(tmp_path):
    with pytest.raises(LaunchError, match="disk full"):
        launch(tw.train_crashing_at_second_save, 1, str(tmp_path), timeout=300)
    assert checkpoint.latest_iteration(tmp_path) == 1
    assert not (tmp_path / "iter_0000002").exists()
    resumed = launch(tw.train_kw, 1, dict(train_iters=2, load=str(tmp_path)), timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [2]


def test_loading_another_model_or_nothing_is_refused(tmp_path):
    launch(tw.train_kw, 1, dict(train_iters=1, save=str(tmp_path)), timeout=300)
    with pytest.raises(LaunchError, match=r"--hidden-size 32 \(now 64\).*cannot be resharded"):
        launch(tw.train_kw, 1, dict(train_iters=2, load=str(tmp_path), hidden_size=64), timeout=300)
    # A --load directory with no checkpoint yet is a restartable job's first run (Megatron's
    # behaviour): it starts from scratch. One with checkpoints but no tracker is damaged.
    fresh = launch(tw.train_kw, 1, dict(train_iters=1, load=str(tmp_path / "empty")), timeout=300)[
        0
    ]
    assert [h["iteration"] for h in fresh] == [1]
    (tmp_path / checkpoint.TRACKER).unlink()
    with pytest.raises(LaunchError, match="no latest_checkpointed_iteration.txt"):
        launch(tw.train_kw, 1, dict(load=str(tmp_path)), timeout=300)


def test_save_interval_without_save_is_refused():
    with pytest.raises(ConfigError, match="--save-interval 2 needs --save"):
        tw.tiny(save_interval=2).check(1)


def test_tensorboard_scalars_match_the_iteration_figures(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    kw = dict(train_iters=3, tensorboard_dir=str(tmp_path), eval_iters=1, eval_interval=2)
    history = launch(tw.train_kw, 1, kw, timeout=300)[0]
    board = event_accumulator.EventAccumulator(str(tmp_path))
    board.Reload()
    losses = [(e.step, e.value) for e in board.Scalars("lm loss")]
    assert [s for s, _ in losses] == [1, 2, 3]
    assert [v for _, v in losses] == pytest.approx([h["loss"] for h in history], rel=1e-6)
    assert [e.value for e in board.Scalars("learning-rate")] == pytest.approx(
        [h["lr"] for h in history], rel=1e-6
    )
    assert "mfu" not in board.Tags()["scalars"]  # no peak on a CPU: nothing to log
    valid = [(e.step, e.value) for e in board.Scalars("lm loss validation")]
    assert valid == [(h["iteration"], pytest.approx(h["valid_loss"])) for h in history[1:]]
    test = [(e.step, e.value) for e in board.Scalars("lm loss test")]
    assert test == [(3, pytest.approx(history[-1]["test_loss"]))]
