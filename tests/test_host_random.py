"""Python's and numpy's global generators, as Megatron-LM treats them: seeded with --seed (plus
1000 per pipeline stage, megart's stage offset), recorded in its checkpoint formats, and
restored by --load (unless --no-load-rng). megart draws nothing from them; what this buys is
files that are the same from run to run, and a resumed process in Megatron-LM's state."""

import pickle
import random

import numpy as np
import pytest

import host_random_workers as hw
import train_workers as tw
from megart.launcher import launch
from megart.training.checkpoint import FILE, iteration_dir
from megart.training.megatron_files import torch_load


def _seeded(seed: int) -> tuple:
    return random.Random(seed).getstate(), np.random.RandomState(seed).get_state()


def _same(a: tuple, b: tuple) -> bool:
    (pa, na), (pb, nb) = a, b
    return pa == pb and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(na, nb, strict=True)
    )


def _file_states(ckpt) -> tuple:
    (r,) = torch_load(iteration_dir(ckpt, 2) / "mp_rank_00" / FILE)["rng_state"]
    return r["random_rng_state"], r["np_rng_state"]


def _save(ckpt, seed: int, fmt: str) -> None:
    kw = dict(train_iters=2, save=str(ckpt), seed=seed, ckpt_format=fmt)
    launch(tw.train_kw, 1, kw, timeout=300)


def test_runs_of_one_seed_record_the_same_states_and_the_seeds_states(tmp_path):
    for name in ("a", "b"):
        _save(tmp_path / name, 7, "torch")
    a, b = _file_states(tmp_path / "a"), _file_states(tmp_path / "b")
    assert _same(a, b)
    assert _same(a, _seeded(7)) and not _same(a, _seeded(8))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_load_restores_the_recorded_states_unless_no_load_rng(tmp_path, fmt):
    _save(tmp_path, 7, fmt)
    # Resumed under another seed, so that the restored states differ from the run's own.
    kw = dict(train_iters=2, load=str(tmp_path), seed=8, ckpt_format=fmt)
    (loaded,) = launch(hw.states_after_loading, 1, kw, timeout=300)
    assert _same(pickle.loads(loaded), _seeded(7))
    (kept,) = launch(hw.states_after_loading, 1, dict(kw, no_load_rng=True), timeout=300)
    assert _same(pickle.loads(kept), _seeded(8))
