"""--data-order megatron: megart's samples equal Megatron-Core 0.16.1's GPTDataset and
BlendedDataset samples (built by its BlendedMegatronDatasetBuilder on the same files, seed,
split and sample counts), sample by sample, tokens and labels."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megatron_order_workers as mow
from megart.training.config import TrainConfig
from megart.training.indexed import write_indexed
from megart.training.megatron_blend import megatron_datasets, num_samples

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list


class _Tokenizer:
    """What GPTDataset reads of a tokenizer: the end-of-document id (no pad id)."""

    eod = 0
    vocab_size = None
    unique_identifiers = {"class": "test tokenizer"}


def _write(directory, name, lengths, seed, vocab=1000):
    rng = np.random.default_rng(seed)
    prefix = str(directory / name)
    write_indexed(prefix, [rng.integers(1, vocab, n) for n in lengths], np.uint16)
    return prefix


def _megatron(cfg: TrainConfig, cache) -> list:
    """Megatron-Core's three datasets for megart's flags, as pretrain_gpt builds them."""
    per_split = [cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path]
    blend = None if any(per_split) else get_blend_from_list(_as_list(cfg.data_path))
    config = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=blend,
        blend_per_split=[get_blend_from_list(_as_list(p)) for p in per_split]
        if any(per_split)
        else None,
        split=None if any(per_split) else (cfg.split or "969,30,1"),
        path_to_cache=str(cache),
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=0.005,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        builder = BlendedMegatronDatasetBuilder(
            GPTDataset, list(num_samples(cfg)), lambda: True, config
        )
        return builder.build()


# BlendedDataset asks torch.distributed for its rank (conftest).
pytestmark = pytest.mark.usefixtures("torch_group_of_one")


def _as_list(path):
    return None if path is None else [path] if isinstance(path, str) else list(path)


def _assert_same(cfg: TrainConfig, cache, splits=(0, 1, 2)) -> None:
    ours = megatron_datasets(cfg, dp=1)
    theirs = _megatron(cfg, cache)
    counts = num_samples(cfg)
    for i in splits:
        assert (ours[i] is None) == (theirs[i] is None), i
        if ours[i] is None:
            continue
        n = counts[i]
        x, y = ours[i].global_batch(cfg.seed, 0, n) if n else (None, None)
        for k in range(n):
            sample = theirs[i][k]
            assert np.array_equal(x[k].numpy(), sample["tokens"].numpy()), (i, k)
            assert np.array_equal(y[k].numpy(), sample["labels"].numpy()), (i, k)


def _config(**kw) -> TrainConfig:
    base = dict(
        seq_length=16,
        vocab_size=1024,
        micro_batch_size=1,
        global_batch_size=4,
        train_iters=30,
        eval_interval=10,
        eval_iters=2,
        seed=1234,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_a_single_prefix_cut_969_30_1_matches_megatron(tmp_path):
    # 400 sequences: the test split (1/1000) keeps round(0.999 * 400)..400, none; 2000 keep 2.
    prefix = _write(tmp_path, "a", np.random.default_rng(0).integers(1, 40, 2000), 1)
    cfg = _config(data_path=prefix, train_iters=300)
    _assert_same(cfg, tmp_path / "cache")


def test_several_epochs_with_and_without_a_separate_final_epoch(tmp_path):
    prefix = _write(tmp_path, "a", np.random.default_rng(2).integers(1, 30, 60), 3)
    for iters in (40, 52, 70):  # epochs whose last is a small or a large share of an epoch
        cfg = _config(data_path=prefix, split="90,10,0", train_iters=iters)
        _assert_same(cfg, tmp_path / f"cache{iters}")


def test_a_weighted_blend_of_two_matches_megatron(tmp_path):
    a = _write(tmp_path, "a", np.random.default_rng(4).integers(1, 50, 300), 5)
    b = _write(tmp_path, "b", np.random.default_rng(6).integers(1, 20, 500), 7)
    cfg = _config(data_path=["0.3", a, "0.7", b], split="98,2,0", train_iters=50)
    _assert_same(cfg, tmp_path / "cache")


def test_prefixes_without_weights_blend_by_their_sample_counts(tmp_path):
    a = _write(tmp_path, "a", np.random.default_rng(8).integers(1, 50, 300), 9)
    b = _write(tmp_path, "b", np.random.default_rng(10).integers(1, 20, 500), 11)
    cfg = _config(data_path=[a, b], split="98,2,0", train_iters=20, eval_iters=1)
    _assert_same(cfg, tmp_path / "cache")


def test_per_split_paths_match_megatron(tmp_path):
    a = _write(tmp_path, "a", np.random.default_rng(12).integers(1, 50, 200), 13)
    b = _write(tmp_path, "b", np.random.default_rng(14).integers(1, 20, 200), 15)
    c = _write(tmp_path, "c", np.random.default_rng(16).integers(1, 30, 100), 17)
    cfg = _config(
        train_data_path=["2", a, "1", b], valid_data_path=c, test_data_path=b, train_iters=40
    )
    _assert_same(cfg, tmp_path / "cache")


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**31 - 1),
    seq_length=st.integers(2, 24),
    lengths=st.lists(st.integers(1, 60), min_size=20, max_size=80),
    iters=st.integers(1, 40),
)
def test_any_seed_sequence_length_and_document_lengths(
    tmp_path_factory, seed, seq_length, lengths, iters
):
    d = tmp_path_factory.mktemp("h")
    prefix = _write(d, "a", np.array(lengths), seed % 1000)
    cfg = _config(
        data_path=prefix, split="80,20,0", seed=seed, seq_length=seq_length, train_iters=iters
    )
    _assert_same(cfg, d / "cache")


def _sampler_slices(n: int, mbs: int, dp: int, rank: int) -> list[list[int]]:
    """Megatron's MegatronPretrainingSampler from sample 0: rank ``rank``'s micro batches, each
    the rank-th run of ``mbs`` samples of every ``mbs * dp`` (written from its documented
    behaviour, not from megart's row order)."""
    return [list(range(s + rank * mbs, s + (rank + 1) * mbs)) for s in range(0, n, mbs * dp)]


def test_a_dp2_training_run_feeds_each_rank_megatrons_sampler_slices(tmp_path):
    from megart.launcher import launch

    prefix = _write(tmp_path, "a", np.random.default_rng(20).integers(1, 40, 400), 21, vocab=200)
    kw = dict(data_path=prefix, data_order="megatron", seq_length=16, vocab_size=256,
              micro_batch_size=2, global_batch_size=8, train_iters=4, eval_interval=2,
              eval_iters=1, split="90,10,0", seed=77)  # fmt: skip
    cfg = _config(**kw)
    fed = launch(mow.fed, 2, kw, timeout=300)
    train, valid, _ = _megatron(cfg, tmp_path / "cache")
    gbs, mbs = cfg.global_batch_size, cfg.micro_batch_size
    for rank, batches in enumerate(fed):
        assert [(s, b) for s, b, _, _ in batches] == [
            ("train", 0),
            ("train", 1),
            ("valid", 0),
            ("train", 2),
            ("train", 3),
            ("valid", 2),
        ]  # validation goes on: batch 1 was Megatron's in-loop evaluation at iteration 4
        for split, b, inputs, targets in batches:
            data = train if split == "train" else valid
            for j, ids in enumerate(_sampler_slices(gbs, mbs, 2, rank)):
                want = [data[b * gbs + i] for i in ids]
                assert inputs[j] == [w["tokens"].tolist() for w in want], (rank, split, b, j)
                assert targets[j] == [w["labels"].tolist() for w in want], (rank, split, b, j)


def test_a_resumed_run_continues_at_megatrons_next_samples(tmp_path):
    """Saved after iteration 2 and resumed, a --data-order megatron run trains iterations 3
    and 4 on the batches (and so with the losses) of the uninterrupted run: the samples from 2
    global batches on, as Megatron's sampler resumes at its consumed samples."""
    import train_workers as tw
    from megart.launcher import launch

    prefix = _write(tmp_path, "a", np.random.default_rng(30).integers(1, 40, 400), 31, vocab=200)
    kw = dict(data_path=prefix, data_order="megatron", seq_length=16, vocab_size=256,
              micro_batch_size=2, global_batch_size=8, train_iters=4, eval_iters=0,
              split="90,10,0", seed=77, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    straight = launch(mow.trained, 1, kw, timeout=300)[0]
    ckpt = str(tmp_path / "ckpt")
    launch(mow.trained, 1, dict(kw, save=ckpt, save_interval=2, exit_interval=2), timeout=300)
    resumed = launch(mow.trained, 1, dict(kw, load=ckpt), timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [3, 4]
    want = [h["loss"] for h in straight[2:]]
    assert [h["loss"] for h in resumed] == pytest.approx(want, **tw.SAME_RUN)
    # The batches differ from iteration to iteration, so a resume at the wrong sample shows.
    assert abs(straight[2]["loss"] - straight[3]["loss"]) > 1e-3


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(mock_data=True), "--mock-data"),
        (dict(), "the built-in corpus"),
        (dict(data_path="a", train_samples=120, train_iters=None), "--train-samples"),
        (dict(data_path="a", rampup_batch_size=[2, 2, 40]), "--rampup-batch-size"),
    ],
)
def test_what_the_megatron_order_does_not_cover_is_refused_by_name(kw, named):
    from megart import ConfigError

    with pytest.raises(
        ConfigError, match=re.escape(f"--data-order megatron does not cover {named}")
    ):
        _config(data_order="megatron", **kw).check(1)


@pytest.mark.parametrize("order", ["megart", "megatron"])
def test_full_validation_is_refused_by_name(order):
    """Megatron-LM's --full-validation: megatron-core 0.16's Megatron-LM stops its evaluation
    once the set is read, and its main branch means something else since (data_checks)."""
    import argparse

    from megart import ConfigError
    from megart.cli.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--full-validation"]).full_validation  # Megatron's name, known
    cfg = _config(data_order=order, data_path="a", full_validation=True)
    with pytest.raises(ConfigError, match=r"^--full-validation is not reproduced.*--eval-iters N"):
        cfg.check(1)
    _config(data_order=order, data_path="a").check(1)  # the default: no refusal


@settings(max_examples=40, deadline=None)
@given(
    raw=st.lists(st.integers(1, 1000), min_size=1, max_size=6),
    size=st.integers(0, 3000),
)
def test_the_blending_order_is_megatron_cores_helper(raw, size):
    """megart's C++ blending rule against Megatron-Core's own compiled helper
    (build_blending_indices), on normalised weights, ties included (equal weights)."""
    helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    from megart.training.megatron_blend import blending_indices, normalize

    weights = normalize(raw)
    which = np.zeros(size, dtype=np.int16)
    nth = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(which, nth, np.array(weights), len(weights), size, False)
    got_which, got_nth = blending_indices(weights, size)
    assert got_which.dtype == np.int16 and got_nth.dtype == np.int64
    assert np.array_equal(got_which, which) and np.array_equal(got_nth, nth)


def test_the_data_cache_path_builds_the_indices_once_and_never_serves_stale_ones(tmp_path):
    """--data-cache-path: a dp2 run's ranks read the indices rank 0 wrote there, and are fed
    what they are fed without it; a second run maps the same files (not rewritten); data
    rewritten under the same prefix gets indices of its own."""
    from megart.launcher import launch

    lengths = np.random.default_rng(40).integers(1, 40, 300)
    prefix = _write(tmp_path, "a", lengths, 41, vocab=200)
    other = _write(tmp_path, "b", np.random.default_rng(42).integers(1, 40, 300), 43, vocab=200)
    cache = tmp_path / "cache"
    kw = dict(data_path=["0.4", prefix, "0.6", other], data_order="megatron", seq_length=16,
              vocab_size=256, micro_batch_size=2, global_batch_size=8, train_iters=3,
              eval_interval=3, eval_iters=1, split="90,10,0", seed=5)  # fmt: skip
    plain = launch(mow.fed, 2, kw, timeout=300)
    assert launch(mow.fed, 2, dict(kw, data_cache_path=str(cache)), timeout=300) == plain
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    # Two datasets' train and valid indices (3 arrays each) and the two blends' (2 each).
    assert len([n for n in files if n.endswith(".json")]) == 6
    assert len([n for n in files if n.endswith(".npy")]) == 4 * 3 + 2 * 2
    assert not [n for n in files if n.endswith(".tmp")]
    assert launch(mow.fed, 2, dict(kw, data_cache_path=str(cache)), timeout=300) == plain
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == files  # mapped, not rebuilt
    _write(tmp_path, "a", lengths[::-1], 44, vocab=200)  # new documents, the same prefix
    changed = launch(mow.fed, 2, dict(kw, data_cache_path=str(cache)), timeout=300)
    assert changed == launch(mow.fed, 2, kw, timeout=300) != plain
    assert len(list(cache.glob("*.json"))) > 6


def test_an_empty_split_megatron_needs_samples_from_is_refused_by_name(tmp_path):
    """969,30,1 of 80 sequences leaves the test split none (Megatron-Core would count epochs
    of no tokens for ever); with --eval-iters 0 nothing is asked of it."""
    from megart import ConfigError
    from megart.training.megatron_blend import megatron_datasets

    prefix = _write(tmp_path, "a", np.full(80, 30), 50, vocab=200)
    cfg = _config(data_path=prefix, data_order="megatron", split="969,30,1", vocab_size=256)
    with pytest.raises(ConfigError, match=r"its test split .* of its 80, --split\) holds no token"):
        megatron_datasets(cfg, 1)
    train, valid, test = megatron_datasets(_config(**{**vars(cfg), "eval_iters": 0}), 1)
    assert train is not None and valid is None and test is None


def test_a_blend_that_asks_a_dataset_for_more_than_it_has_is_refused():
    from megart import ConfigError
    from megart.training.megatron_blend import BlendOrder

    class Part:  # what BlendOrder reads of a dataset: its length and description
        def __init__(self, n: int) -> None:
            self.n, self.description = n, {"n": n}

        def __len__(self) -> int:
            return self.n

    sized = [Part(50), Part(3)]
    BlendOrder(sized, [0.5, 0.5], 6)  # 3 each: enough
    with pytest.raises(ConfigError, match="asks dataset 1 for 4 samples, more than its 3"):
        BlendOrder(sized, [0.5, 0.5], 8)
