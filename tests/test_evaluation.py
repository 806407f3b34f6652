"""Validation loss (--eval-interval, --eval-iters, --split): the forward-only pipeline pass gives
the whole model's loss, the same under every layout, and never changes the training curve."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.training.config import TrainConfig
from megart.training.data import split_tokens

EVAL = dict(eval_iters=2, eval_interval=2, train_iters=3)


def _train_with(kw):
    return tw.train(**kw)


@pytest.fixture(scope="module")
def reference():
    return launch(_train_with, 1, EVAL, timeout=300)[0]


def test_evaluation_equals_the_whole_model_called_directly():
    valid, test = launch(tw.evaluation_against_the_whole_model, 1, EVAL, timeout=300)[0]
    for got, want in (valid, test):
        assert got == pytest.approx(want, rel=1e-6)
    assert valid[1] != test[1]  # two ranges, two losses


def test_validation_runs_every_interval_and_after_the_last_iteration(reference):
    assert [("valid_loss" in h) for h in reference] == [False, True, True]
    for h in reference[1:]:
        assert h["valid_ppl"] == pytest.approx(np.exp(h["valid_loss"]))
    assert reference[2]["valid_loss"] < reference[1]["valid_loss"]  # it is learning


def test_the_test_range_is_evaluated_once_after_the_last_iteration(reference):
    assert [("test_loss" in h) for h in reference] == [False, False, True]
    assert reference[2]["test_ppl"] == pytest.approx(np.exp(reference[2]["test_loss"]))
    assert reference[2]["test_loss"] != reference[2]["valid_loss"]  # another range
    no_test_range = launch(_train_with, 1, {**EVAL, "split": "98,2,0"}, timeout=300)[0]
    assert not any("test_loss" in h for h in no_test_range)


@pytest.mark.parametrize(
    "nproc, kw",
    [
        (2, dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)),
        (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        (4, dict(pipeline_model_parallel_size=2)),  # with dp 2
        # scatter/gather between the stages: each rank sends 1/t of an activation
        (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ],
    ids=["pp2-interleaved", "tp2-sequence-parallel", "pp2-dp2", "tp2-pp2"],
)
def test_validation_loss_is_the_same_under_every_layout(nproc, kw, reference):
    for history in launch(_train_with, nproc, {**EVAL, **kw}, timeout=300):
        for h, r in zip(history, reference, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
            for key in ("valid_loss", "test_loss"):
                assert h.get(key, 0.0) == pytest.approx(r.get(key, 0.0), rel=1e-5)


def test_evaluating_never_changes_the_training_curve():
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1, train_iters=3)
    without = launch(_train_with, 1, {**dropout, "eval_iters": 0}, timeout=300)[0]
    evaluated = {**dropout, "eval_iters": 2, "eval_interval": 1}
    with_eval = launch(_train_with, 1, evaluated, timeout=300)[0]
    assert all("valid_loss" in h for h in with_eval)
    # Not bitwise (see tw.SAME_RUN): an evaluation that leaves dropout on moves iteration 1's
    # loss by 4e-4, far outside.
    for h, w in zip(with_eval, without, strict=True):
        assert h["loss"] == pytest.approx(w["loss"], **tw.SAME_RUN)
        assert h["grad_norm"] == pytest.approx(w["grad_norm"], **tw.SAME_RUN)


@given(st.integers(0, 10_000), st.lists(st.integers(0, 1000), min_size=1, max_size=3))
def test_split_cuts_consecutive_ranges_in_proportion(n, weights):
    weights[0] = max(weights[0], 1)
    tokens = np.arange(n)
    parts = split_tokens(tokens, ",".join(map(str, weights)))
    assert np.array_equal(np.concatenate(parts), tokens)
    total = sum(weights)
    for part, w in zip(parts, weights, strict=False):
        assert abs(len(part) - n * w / total) <= 1.0


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(split="a,b"), "--split 'a,b': give up to three non-negative weights"),
        (dict(split="0,1,1"), "with a positive train weight"),
        (dict(split="9,1,1,1"), "give up to three"),
        (dict(eval_iters=-1), "--eval-iters -1 must be at least 0"),
        (dict(eval_interval=0), "--eval-interval 0 at least 1"),
    ],
)
def test_bad_evaluation_flags_are_refused_saying_what_to_change(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig(**kw).check(1)


def test_a_validation_split_too_small_is_refused_before_any_work():
    kw = dict(split="1000,0,0", eval_iters=1)
    with pytest.raises(Exception, match=r"validation split of --split '1000,0,0' \(or set"):
        launch(_train_with, 1, kw, timeout=120)


def test_megart_train_logs_validation_to_jsonl(tmp_path):
    log = tmp_path / "log.jsonl"
    kw = {**EVAL, "log_jsonl": str(log), "eval_interval": 3}
    launch(_train_with, 1, kw, timeout=300)
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert ["valid_loss" in r for r in rows] == [False, False, True]
