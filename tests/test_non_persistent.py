"""Megatron-LM's non-persistent checkpoints (--non-persistent-save-interval N
--non-persistent-ckpt-type global): every N iterations where no --save-interval checkpoint is
due, a whole checkpoint in <save>/non_persistent (or --non-persistent-global-ckpt-dir); each
deletes the older ones there but the newest; --load resumes from the newest of both kinds. The
reference for a resume is the uninterrupted run: the state held when the killed run saved, and
its loss curve."""

from pathlib import Path

import pytest

import save_workers as sw
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.training.checkpoint import latest_iteration

NP = dict(non_persistent_ckpt_type="global")


def _kept(directory) -> list[int]:
    return sorted(int(p.name[len("iter_") :]) for p in Path(directory).glob("iter_*"))


@pytest.fixture(scope="module")
def straight():
    return launch(tw.train_kw, 1, dict(train_iters=6), timeout=300)[0]


@pytest.mark.parametrize("ckpt_format", ["megart", "torch_dist"])
def test_a_run_killed_after_a_non_persistent_save_resumes_from_it(tmp_path, straight, ckpt_format):
    kw = dict(train_iters=6, save=str(tmp_path), save_interval=4, ckpt_format=ckpt_format,
              non_persistent_save_interval=1, **NP)  # fmt: skip
    killed = launch(sw.killed_after, 1, kw, 3, timeout=300)[0]
    np_dir = tmp_path / "non_persistent"
    # Saves 1, 2, 3 there: 1 went before 3 was written (all but the newest), none persistent.
    assert _kept(np_dir) == [2, 3] and latest_iteration(np_dir) == 3
    assert _kept(tmp_path) == [] and latest_iteration(tmp_path) is None
    resumed = tw.holding(1, dict(kw, load=str(tmp_path)))
    tw.assert_holds([killed["held"]], resumed)
    history = resumed[0]["history"]
    assert [h["iteration"] for h in history] == [4, 5, 6]
    want = [h["loss"] for h in straight[3:]]
    assert [h["loss"] for h in history] == pytest.approx(want, **tw.SAME_RUN)
    # Persistent 4 and 6 stay; non-persistent 5 deleted 2 (not 3, the newest before it).
    assert _kept(tmp_path) == [4, 6] and _kept(np_dir) == [3, 5]


def test_a_newer_persistent_checkpoint_wins_and_the_directory_may_be_elsewhere(tmp_path, straight):
    elsewhere = tmp_path / "scratch"
    kw = dict(train_iters=6, save=str(tmp_path / "ckpt"), save_interval=3,
              non_persistent_save_interval=2, non_persistent_global_ckpt_dir=str(elsewhere),
              **NP)  # fmt: skip
    killed = launch(sw.killed_after, 1, kw, 3, timeout=300)[0]
    assert _kept(elsewhere) == [2] and _kept(tmp_path / "ckpt") == [3]
    resumed = tw.holding(1, dict(kw, load=str(tmp_path / "ckpt")))
    tw.assert_holds([killed["held"]], resumed)
    assert [h["iteration"] for h in resumed[0]["history"]] == [4, 5, 6]
    assert not (tmp_path / "ckpt" / "non_persistent").exists()


def test_without_the_type_load_reads_only_persistent_checkpoints(tmp_path):
    kw = dict(train_iters=6, save=str(tmp_path), save_interval=2, non_persistent_save_interval=1,
              **NP)  # fmt: skip
    launch(sw.killed_after, 1, kw, 3, timeout=300)
    assert latest_iteration(tmp_path / "non_persistent") == 3 and _kept(tmp_path) == [2]
    resumed = tw.holding(1, dict(train_iters=6, load=str(tmp_path)))
    assert [h["iteration"] for h in resumed[0]["history"]] == [3, 4, 5, 6]


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(non_persistent_save_interval=2, save="x"), "needs --non-persistent-ckpt-type"),
        (dict(non_persistent_ckpt_type="local"), "--non-persistent-ckpt-type local"),
        (dict(non_persistent_ckpt_type="in_memory"), "--non-persistent-ckpt-type in_memory"),
        (dict(non_persistent_save_interval=2, **NP), "give --save"),
        (dict(non_persistent_save_interval=0, save="x", **NP), "must be at least 1"),
        (dict(non_persistent_save_interval=2, save="x", ckpt_format="torch", **NP),
         "--ckpt-format torch"),
        (dict(non_persistent_global_ckpt_dir="d"), "add that type"),
    ],
)  # fmt: skip
def test_what_megart_does_not_do_is_refused_by_name(kw, says):
    with pytest.raises(ConfigError, match=says):
        tw.tiny(**kw).check(1)


def test_use_checkpoint_args_reads_the_checkpoint_load_resumes(tmp_path, capsys):
    """As Megatron-LM's load_args_from_checkpoint (through _load_base_checkpoint): the flags
    come from the newer non-persistent checkpoint when that is what --load resumes."""
    from test_checkpoint_args import flags_config

    kw = dict(train_iters=4, hidden_size=48, save=str(tmp_path), save_interval=10,
              non_persistent_save_interval=1, **NP)  # fmt: skip
    launch(sw.killed_after, 1, kw, 2, timeout=300)
    assert latest_iteration(tmp_path) is None and latest_iteration(tmp_path / "non_persistent") == 2
    argv = [
        "--load",
        str(tmp_path),
        "--use-checkpoint-args",
        "--non-persistent-ckpt-type",
        "global",
    ]
    assert flags_config(argv).hidden_size == 48
    assert f"flags from {tmp_path / 'non_persistent' / 'iter_0000002'}" in capsys.readouterr().out
    # Without the type only persistent checkpoints count, as --load's resume: none here.
    with pytest.raises(ConfigError, match="no latest_checkpointed_iteration.txt there"):
        flags_config(argv[:3])
