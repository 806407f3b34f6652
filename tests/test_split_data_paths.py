"""Megatron-LM's --train-data-path, --valid-data-path and --test-data-path: each split its own
dataset (or blend, in --data-path's forms), read whole instead of cut by --split; training reads
the first, evaluation the second, the test the third; what Megatron-LM does not combine with
them is refused by name."""

import numpy as np
import pytest

import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.training.data import (
    BlendedDataset,
    TokenDataset,
    build_datasets,
    build_split_datasets,
)
from megart.training.indexed import write_indexed

SEQ = 8
BIG = 1 << 20  # a vocabulary that holds the position-valued tokens below


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """Three datasets whose tokens are their positions, offset by 1e5 per dataset: a window
    tells which dataset and where in it it was read."""
    d = tmp_path_factory.mktemp("counting")
    sizes = {"a": 20_000, "b": 60_000, "c": 3_000}
    out = {}
    for k, (name, n) in enumerate(sizes.items()):
        write_indexed(d / name, [np.arange(n) + 100_000 * k], np.int32)
        out[name] = (str(d / name), 100_000 * k, n)
    return out


def _windows(data, batches=60, size=32):
    for it in range(batches):
        x, y = data.global_batch(1234, it, size)
        assert (x[:, 1:] == y[:, :-1]).all()  # targets are the inputs shifted by one
        yield from x.numpy()


def test_each_split_is_its_own_dataset_read_whole(counting):
    (a, _, _), (b, b0, nb), (c, c0, nc) = counting["a"], counting["b"], counting["c"]
    train, valid, test = build_split_datasets(([a], [b], [c]), SEQ, BIG)
    for data, (low, n) in ((valid, (b0, nb)), (test, (c0, nc))):
        starts = []
        for w in _windows(data):
            assert (np.diff(w) == 1).all()  # one contiguous window
            assert low <= w[0] and w[-1] < low + n  # of this split's dataset only
            starts.append(w[0] - low)
        # Read whole: windows beyond where --split 969,30,1 would end the validation range.
        assert max(starts) > 0.97 * n and min(starts) < 0.03 * n
    assert all(w[-1] < 20_000 for w in _windows(train))


def test_a_split_equals_data_path_over_the_whole_dataset(counting):
    """The same draws as --data-path with all of it for training (--split 1,0,0)."""
    a, b = counting["a"][0], counting["b"][0]
    blend = ["0.3", a, "0.7", b]
    _, valid, _ = build_split_datasets(([a], blend, None), SEQ, BIG)
    same, _, _ = build_datasets(blend, "1,0,0", SEQ, BIG, evaluate=False)
    assert isinstance(valid, BlendedDataset)
    for it in (0, 5):
        for u, v in zip(valid.global_batch(7, it, 16), same.global_batch(7, it, 16), strict=True):
            assert (u == v).all()


def _shares(data, n_sets=2):
    picks = [int(w[0] // 100_000) for w in _windows(data, batches=50, size=64)]
    return np.bincount(picks, minlength=n_sets) / len(picks)


@pytest.mark.parametrize("weight", [0.2, 0.65])
def test_a_weighted_blend_per_split_follows_its_weights(counting, weight):
    a, b = counting["a"][0], counting["b"][0]
    train, valid, test = build_split_datasets(
        ([str(weight), a, str(1 - weight), b], None, None), SEQ, BIG
    )
    assert valid is None and test is None  # no path, no dataset (Megatron: no evaluation)
    share = _shares(train)[1]
    sd = (weight * (1 - weight) / 3200) ** 0.5
    assert abs(share - (1 - weight)) < 4.5 * sd


def test_prefixes_alone_are_weighted_by_their_whole_sizes(counting):
    a, b = counting["a"][0], counting["b"][0]
    train, _, _ = build_split_datasets(([a, b], None, None), SEQ, BIG, evaluate=False)
    assert float(train.weights[1]) == pytest.approx(60_000 / 80_000)


def test_without_evaluation_no_valid_or_test_dataset_is_opened(counting):
    train, valid, test = build_split_datasets(
        ([counting["a"][0]], ["no-such-prefix"], ["nor-this"]), SEQ, BIG, evaluate=False
    )
    assert isinstance(train, TokenDataset) and valid is None and test is None


def _parse(argv):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(argv))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--data-path", "x", "--train-data-path", "y"], "--data-path and --train-data-path"),
        (["--mock-data", "--valid-data-path", "y"], "--mock-data and --valid-data-path"),
        (["--split", "90,5,5", "--train-data-path", "y"], "--split 90,5,5 with --train-data"),
        (["--valid-data-path", "y", "--test-data-path", "z"], "without --train-data-path"),
    ],
)
def test_what_megatron_does_not_combine_is_refused_by_name(argv, says):
    with pytest.raises(ConfigError, match=says):
        _parse(argv).check(1)


def test_the_flags_take_blends():
    c = _parse(["--train-data-path", "0.5", "x", "0.5", "y", "--valid-data-path", "v"])
    assert c.train_data_path == ["0.5", "x", "0.5", "y"] and c.valid_data_path == ["v"]
    assert c.split is None and c.test_data_path is None


def _write_small(directory):
    """Three byte-vocabulary datasets of separate id ranges (a model's loss tells them apart)."""
    out = []
    for k, (low, high) in enumerate(((0, 100), (100, 200), (200, 256))):
        rng = np.random.default_rng(k)
        prefix = f"{directory}/{'abc'[k]}"
        write_indexed(prefix, [rng.integers(low, high, 30_000)], np.uint8)
        out.append(prefix)
    return out


def _trained_and_evaluated(kw):
    from megart.training.indexed import IndexedTokens
    from megart.training.trainer import Trainer

    a, b, c = kw.pop("paths")
    run = dict(vocab_size=256, eval_iters=2, eval_interval=2, **kw)
    t = Trainer(tw.tiny(train_data_path=a, valid_data_path=b, test_data_path=c, **run))
    history = t.train(quiet=True)
    whole = {p: TokenDataset(IndexedTokens(p).tokens, t.config.seq_length) for p in (a, b, c)}
    by_hand = {p: t.evaluate(data) for p, data in whole.items()}
    cut = Trainer(tw.tiny(data_path=a, split="1,0,0", **{**run, "eval_iters": 0}))
    return history, by_hand, cut.train(quiet=True)


def test_training_reads_the_train_set_and_evaluation_the_valid_and_test_sets(tmp_path):
    a, b, c = _write_small(tmp_path)
    history, by_hand, cut = launch(
        _trained_and_evaluated, 1, {"paths": (a, b, c), "train_iters": 4}, timeout=300
    )[0]
    last = history[-1]
    # The same weights evaluated by hand on each whole dataset: valid is b's, test is c's.
    assert last["valid_loss"] == pytest.approx(by_hand[b], rel=1e-6)
    assert last["test_loss"] == pytest.approx(by_hand[c], rel=1e-6)
    assert len({round(v, 3) for v in by_hand.values()}) == 3  # three datasets, three losses
    # Training on --train-data-path a is training on --data-path a --split 1,0,0.
    assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in cut], **tw.SAME_RUN)
