"""--save-retain-interval, as Megatron-LM's checkpointing applies it: once a checkpoint is
complete, the one the tracker named before it is deleted unless its iteration is a multiple of
the interval; earlier checkpoints and symbolic links stay."""

import os

import pytest

import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.training.checkpoint import iteration_dir, latest_iteration


def _kept(directory) -> list[int]:
    return sorted(int(p.name[len("iter_") :]) for p in directory.glob("iter_*"))


@pytest.mark.parametrize("ckpt_format", ["megart", "torch_dist"])
def test_the_retained_checkpoints_and_the_latest_stay_and_the_latest_resumes(tmp_path, ckpt_format):
    kw = dict(train_iters=7, save=str(tmp_path), save_interval=1, ckpt_format=ckpt_format,
              tensor_model_parallel_size=2)  # fmt: skip
    launch(tw.train_kw, 2, dict(kw, save_retain_interval=2, exit_interval=6), timeout=300)
    # Saves 1..6: 1 goes when 2 completes, 3 when 4 does, 5 when 6 does.
    assert _kept(tmp_path) == [2, 4, 6] and latest_iteration(tmp_path) == 6
    resumed = launch(tw.train_kw, 2, dict(kw, load=str(tmp_path)), timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [7]
    assert _kept(tmp_path) == [2, 4, 6, 7]  # without the flag nothing is deleted


def test_checkpoints_from_before_and_links_stay(tmp_path):
    kw = dict(train_iters=2, lr_decay_iters=10, save=str(tmp_path), save_interval=1)
    launch(tw.train_kw, 1, kw, timeout=300)  # 1 and 2, no retention
    os.replace(iteration_dir(tmp_path, 2), tmp_path / "kept_2")
    os.symlink(tmp_path / "kept_2", iteration_dir(tmp_path, 2))
    kw = dict(kw, train_iters=5, load=str(tmp_path), save_retain_interval=3)
    launch(tw.train_kw, 1, kw, timeout=300)
    # 3 completes: 2 is a link, kept; 4: 3 is a multiple; 5: 4 goes. 1 predates the flag.
    assert _kept(tmp_path) == [1, 2, 3, 5] and iteration_dir(tmp_path, 2).is_symlink()


def test_an_interval_that_is_no_multiple_of_the_save_interval_is_refused():
    for retain, save_interval in ((3, 2), (0, 1), (2, None)):
        with pytest.raises(
            ConfigError, match="--save-retain-interval .* positive multiple of --save-interval"
        ):
            tw.tiny(save="x", save_interval=save_interval, save_retain_interval=retain).check(1)
