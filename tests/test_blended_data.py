"""Blended --data-path, as Megatron's: `W1 PREFIX1 W2 PREFIX2 ...` draws each sample from a
dataset chosen with those weights (`PREFIX1 PREFIX2 ...`: weighted by size), each dataset cut by
--split on its own; batches stay a pure function of (seed, iteration); bad lists are refused."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.training.data import BlendedDataset, build_datasets, parse_blend
from megart.training.indexed import write_indexed

SEQ = 8


def _write(prefix, low, high, n):
    """A dataset whose token ids all lie in [low, high): a sample tells where it came from."""
    rng = np.random.default_rng(low)
    write_indexed(prefix, [rng.integers(low, high, n)], np.uint16)
    return str(prefix)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    return _write(d / "a", 0, 100, 20_000), _write(d / "b", 100, 200, 60_000)


def test_the_forms_megatron_accepts():
    assert parse_blend("d") == [(1.0, "d")]
    assert parse_blend(["d"]) == [(1.0, "d")]
    assert parse_blend(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_blend(["a", "b", "c"]) == [(None, "a"), (None, "b"), (None, "c")]


@pytest.mark.parametrize(
    "items", [["0.3", "a", "0.7"], ["0.5", "a", "b"], ["-1", "a", "2", "b"], ["0", "a", "0", "b"]]
)
def test_bad_blends_are_refused(items):
    with pytest.raises(ConfigError, match="--data-path"):
        parse_blend(items)


def _source(x):
    """0 for a sample of dataset a, 1 for b (every token of a sample comes from one)."""
    lo, hi = int(x.min()), int(x.max())
    assert hi < 100 or lo >= 100, "a sample mixes datasets"
    return int(lo >= 100)


@settings(max_examples=10, deadline=None)
@given(weight=st.floats(0.05, 0.95), seed=st.integers(0, 1000))
def test_samples_follow_the_weights(two, weight, seed):
    train, _, _ = build_datasets(
        [str(weight), two[0], str(1 - weight), two[1]], "98,1,1", SEQ, 256, evaluate=False
    )
    assert isinstance(train, BlendedDataset)
    n = 0
    from_b = 0
    for it in range(50):
        x, y = train.global_batch(seed, it, 64)
        assert (x[:, 1:] == y[:, :-1]).all()  # targets are the inputs shifted by one
        from_b += sum(_source(row) for row in x)
        n += len(x)
    # 3200 draws: the share of b is within 4.5 standard deviations of its weight.
    sd = (weight * (1 - weight) / n) ** 0.5
    assert abs(from_b / n - (1 - weight)) < 4.5 * sd
    again = train.global_batch(seed, 7, 64)
    assert all((u == v).all() for u, v in zip(again, train.global_batch(seed, 7, 64), strict=True))


def test_prefixes_alone_are_weighted_by_size(two):
    train, _, _ = build_datasets(list(two), "98,1,1", SEQ, 256, evaluate=False)
    share = float(train.weights[1])
    assert share == pytest.approx(60_000 / 80_000, rel=1e-3)


def test_each_dataset_is_split_on_its_own(two):
    _, valid, test = build_datasets(["1", two[0], "1", two[1]], "90,5,5", SEQ, 256)
    whole_a = np.asarray(build_datasets(two[0], "100,0,0", SEQ, 256, evaluate=False)[0].tokens)
    for ds, (lo, hi) in ((valid, (0.90, 0.95)), (test, (0.95, 1.0))):
        assert isinstance(ds, BlendedDataset)
        part_a = np.asarray(ds.parts[0].tokens)
        assert (part_a == whole_a[round(len(whole_a) * lo) : round(len(whole_a) * hi)]).all()
        assert {_source(x) for x in ds.global_batch(0, 0, 64)[0]} == {0, 1}


def test_megart_train_parses_a_blend():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--data-path", "0.3", "a", "0.7", "b"]))
    assert config.data_path == ["0.3", "a", "0.7", "b"]


def test_a_blend_trains_the_same_under_data_parallelism(two):
    path = ["0.25", two[0], "0.75", two[1]]
    one = launch(tw.train_on, 1, path, 256, timeout=300)[0]
    for history in launch(tw.train_on, 2, path, 256, timeout=300):
        assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in one], rel=1e-5)
