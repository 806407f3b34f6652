"""Megatron-LM's checkpoint flags: --ckpt-step N (load that iteration, not the latest),
--no-save-optim / --no-save-rng (checkpoints without them, resumed only with --no-load-optim /
--no-load-rng or --finetune, as Megatron-LM's loader insists) and --exit-on-missing-checkpoint.
The reference for a resume is the uninterrupted run's loss curve."""

import pytest

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.training.checkpoint import FILE, iteration_dir, read_file
from megart.training.megatron_files import torch_load


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four iterations, saved after the second and the fourth: (directory, the history)."""
    ckpt = tmp_path_factory.mktemp("straight")
    kw = dict(train_iters=4, save=str(ckpt), save_interval=2)
    return ckpt, launch(tw.train_holding, 1, kw, timeout=300)[0]["history"]


def test_ckpt_step_resumes_the_iteration_asked_for_not_the_latest(straight):
    ckpt, history = straight
    resumed = launch(tw.train_holding, 1, dict(train_iters=4, load=str(ckpt), ckpt_step=2),
                     timeout=300)  # fmt: skip
    tw.assert_resumed_on_curve(history, resumed, rel=1e-6)
    with pytest.raises(Exception, match=r"no checkpoint of iteration 3 \(it holds iter_0000002, "
                       r"iter_0000004\); pass one of those, or leave --ckpt-step out"):  # fmt: skip
        launch(tw.train_holding, 1, dict(train_iters=4, load=str(ckpt), ckpt_step=3), timeout=300)


@pytest.mark.parametrize("ckpt_format", ["megart", "torch"])
def test_a_checkpoint_without_its_optimizer_resumes_only_when_told(tmp_path, straight, ckpt_format):
    _, history = straight
    kw = dict(train_iters=2, save=str(tmp_path), no_save_optim=True, ckpt_format=ckpt_format)
    saved = launch(tw.train_holding, 1, kw, timeout=300)[0]
    path = iteration_dir(tmp_path, 2) / "mp_rank_00" / FILE
    if ckpt_format == "torch":  # Megatron-LM's --no-save-optim writes neither key
        raw = torch_load(path)
        assert "optimizer" not in raw and "opt_param_scheduler" not in raw
    assert read_file(path)["optimizer"] is None
    again = dict(train_iters=4, load=str(tmp_path))
    with pytest.raises(Exception, match="holds no optimizer state .* resume with --no-load-optim"):
        launch(tw.train_holding, 1, again, timeout=300)
    resumed = launch(tw.train_holding, 1, {**again, "no_load_optim": True}, timeout=300)
    assert [h["iteration"] for h in resumed[0]["history"]] == [3, 4]  # the saved iteration on
    assert resumed[0]["loaded"]["optimizer_states"] == 0  # fresh moments
    for name, w in saved["trained"]["weights"].items():
        assert w.equal(resumed[0]["loaded"]["weights"][name]), name
    # The same weights give the uninterrupted curve's third loss; fresh moments then step off it.
    losses = [h["loss"] for h in resumed[0]["history"]]
    assert losses[0] == pytest.approx(history[2]["loss"], rel=1e-6)
    assert losses[1] != pytest.approx(history[3]["loss"], rel=1e-6)


def test_a_checkpoint_without_its_random_streams_resumes_only_when_told(tmp_path, straight):
    kw = dict(train_iters=2, save=str(tmp_path), no_save_rng=True)
    launch(tw.train_holding, 1, kw, timeout=300)
    assert read_file(iteration_dir(tmp_path, 2) / "mp_rank_00" / FILE)["rng"] is None
    again = dict(train_iters=4, load=str(tmp_path))
    with pytest.raises(Exception, match="holds no random streams .* resume with --no-load-rng"):
        launch(tw.train_holding, 1, again, timeout=300)
    resumed = launch(tw.train_holding, 1, {**again, "no_load_rng": True}, timeout=300)
    # The optimizer state is all there, and without dropout the streams change nothing here.
    tw.assert_resumed_on_curve(straight[1], resumed, rel=1e-6)


def test_exit_on_missing_checkpoint_stops_where_a_first_run_would_start(tmp_path):
    kw = dict(train_iters=1, load=str(tmp_path / "none"), exit_on_missing_checkpoint=True)
    with pytest.raises(Exception, match="holds no checkpoint and --exit-on-missing-checkpoint"):
        launch(tw.train_holding, 1, kw, timeout=300)
    del kw["exit_on_missing_checkpoint"]
    assert launch(tw.train_holding, 1, kw, timeout=300)[0]["history"]  # from scratch


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(ckpt_step=2), "--ckpt-step choose what --load DIR restores"),
        (dict(exit_on_missing_checkpoint=True), "--exit-on-missing-checkpoint choose what"),
        (dict(load="x", ckpt_step=-1), "--ckpt-step -1: give an iteration that --load holds"),
        (dict(no_save_optim=True), "--no-save-optim choose what --save DIR writes"),
        (
            dict(save="x", no_save_rng=True, ckpt_format="torch_dist"),
            "--no-save-rng with --ckpt-format torch_dist",
        ),  # fmt: skip
    ],
)
def test_the_flags_without_what_they_need_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        tw.tiny(**flags).check(1)


def test_use_checkpoint_args_reads_the_step_asked_for(straight, tmp_path, capsys):
    """--use-checkpoint-args takes the model of the iteration --ckpt-step names, as Megatron-LM
    reads that step's args: here iteration 2 of a GPT-2 and a later SwiGLU model's 5."""
    import shutil

    from megart.cli.main import main as megart_main
    from test_hf_llama import train_config

    ckpt, other = straight[0], tmp_path / "other"
    launch(tw.train_holding, 1, dict(train_iters=2, save=str(other), swiglu=True), timeout=300)
    mixed = tmp_path / "mixed"
    shutil.copytree(iteration_dir(ckpt, 2), iteration_dir(mixed, 2))
    shutil.copytree(iteration_dir(other, 2), iteration_dir(mixed, 5))
    (mixed / "latest_checkpointed_iteration.txt").write_text("5\n")
    argv = ["--load", str(mixed), "--use-checkpoint-args", "--train-iters", "4"]
    assert train_config(argv).swiglu
    assert not train_config([*argv, "--ckpt-step", "2"]).swiglu
    capsys.readouterr()
    assert megart_main(["train", *argv, "--ckpt-step", "3"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of iteration 3 (it holds iter_0000002, iter_0000005)" in err
    assert err.count("\n") == 1
