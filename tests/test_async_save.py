"""--async-save (Megatron-LM's, torch_dist only): the snapshot is taken at the save and written
in the background; the tracker names the checkpoint only once every rank's files are complete
(finalized before the next save, at the end of training, and after an exception in training
when the files are whole); the files and the resume are those of a synchronous save."""

from pathlib import Path

import pytest
import torch

import save_workers as sw
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.training.checkpoint import iteration_dir, latest_iteration

DIST = dict(ckpt_format="torch_dist")


def _same(a, b, where=""):
    """Equal, recursively: tensors bit for bit, numpy arrays element for element."""
    import numpy as np

    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _same(vars(a), vars(b), where)
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same tp2 run saved after iterations 2 and 4, synchronously and in the background."""
    out = {}
    for name, extra in (("sync", {}), ("async", {"async_save": True})):
        d = tmp_path_factory.mktemp(name)
        kw = dict(train_iters=4, save=str(d), save_interval=2, tensor_model_parallel_size=2)
        out[name] = (d, launch(tw.train_kw, 2, {**kw, **DIST, **extra}, timeout=300)[0])
    return out


def test_async_and_sync_saves_write_the_same_checkpoints(both):
    (sync, _), (background, history) = both["sync"], both["async"]
    assert latest_iteration(background) == 4 and [h["iteration"] for h in history] == [1, 2, 3, 4]
    for it in (2, 4):
        a, b = iteration_dir(sync, it), iteration_dir(background, it)
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        _same(sw.whole_store(str(a)), sw.whole_store(str(b)), f"iter {it}")
        common = [torch.load(d / "common.pt", weights_only=False) for d in (a, b)]
        for c in common:  # the flags that differ: where each run saved, and how
            vars(c["args"]).pop("save"), vars(c["args"]).pop("async_save", None)
        _same(*common, "common")
    assert not list(Path(background).glob("*.partial"))


def test_a_run_resumed_from_an_async_save_continues_the_curve(both, tmp_path):
    straight = launch(tw.train_kw, 1, dict(train_iters=4), timeout=300)[0]
    d = tmp_path / "half"
    kw = dict(train_iters=4, save=str(d), save_interval=2, exit_interval=2, async_save=True)
    launch(tw.train_kw, 2, {**kw, **DIST, "tensor_model_parallel_size": 2}, timeout=300)
    assert latest_iteration(d) == 2  # finalized when the early exit ends training
    resumed = tw.holding(1, dict(train_iters=4, load=str(d), **DIST))
    tw.assert_resumed_on_curve(straight, resumed, **tw.SAME_RUN)


def test_what_training_changes_after_the_snapshot_stays_out_of_the_checkpoint(tmp_path):
    kw = dict(train_iters=4, exit_interval=2, save=str(tmp_path), async_save=True, **DIST)
    out = launch(sw.changed_after_the_snapshot, 1, kw, timeout=300)[0]
    # While the write waited: the folder only partial, the tracker on the run's last save.
    assert out["waiting"] == {"names": ["iter_0000002", "iter_0000003.partial",
                              "latest_checkpointed_iteration.txt"], "tracker": "2"}  # fmt: skip
    assert latest_iteration(tmp_path) == 3
    resumed = tw.holding(1, dict(train_iters=4, load=str(tmp_path), **DIST))
    tw.assert_holds([out["held"]], resumed)
    saved_rng, loaded_rng = out["held"]["rng"], resumed[0]["loaded"]["rng"]
    _same(saved_rng, loaded_rng, "rng")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_save_in_flight_when_training_fails_is_completed(tmp_path, tp):
    """Every rank fails while its write waits; rank 0 publishes once every writer's files are
    complete (at tp2, rank 1's too), with no wait on the other rank's training."""
    kw = dict(train_iters=4, save=str(tmp_path), save_interval=2, async_save=True,
              tensor_model_parallel_size=tp, **DIST)  # fmt: skip
    out = launch(sw.failing_in_training, tp, kw, 3, timeout=300)
    assert [o["error"] for o in out] == ["a failure in training"] * tp
    assert latest_iteration(tmp_path) == 2 and not list(tmp_path.glob("*.partial"))
    assert not [p.name for p in iteration_dir(tmp_path, 2).glob("__*") if "distcp" not in p.name]
    straight = launch(tw.train_kw, 1, dict(train_iters=4), timeout=300)[0]
    resumed = tw.holding(1, dict(train_iters=4, load=str(tmp_path), **DIST))
    tw.assert_resumed_on_curve(straight, resumed, **tw.SAME_RUN)


def test_a_failed_background_write_is_never_named_complete(tmp_path):
    kw = dict(train_iters=4, save=str(tmp_path), save_interval=2, async_save=True, **DIST)
    out = launch(sw.failing_write, 1, kw, timeout=300)[0]
    assert out["error"].startswith("CheckpointError: the background save of iteration 2")
    assert "disk full (simulated)" in out["error"]
    assert latest_iteration(tmp_path) is None and not iteration_dir(tmp_path, 2).exists()


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(async_save=True, save="x"), "--async-save with --ckpt-format megart"),
        (dict(async_save=True, save="x", ckpt_format="torch"), "only torch_dist checkpoints"),
        (dict(async_save=True, **DIST), "give --save"),
    ],
)
def test_other_formats_are_refused_by_name(kw, says):
    with pytest.raises(ConfigError, match=says):
        tw.tiny(**kw).check(1)
