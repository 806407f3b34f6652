"""--fp16: fp16 compute under autocast with fp32 weights and loss scaling. A step whose
gradients overflow is skipped on every rank (weights unchanged) and the dynamic scale halves;
once the scale fits, training proceeds and follows the fp32 curve closely."""

import math

import pytest

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch


def test_dynamic_scale_skips_overflowing_steps_then_trains():
    history = launch(
        tw.train_tracking_weights, 1, dict(fp16=True, initial_loss_scale=2.0**24, train_iters=16),
        timeout=300,
    )[0]  # fmt: skip
    skipped = [h["skipped"] for h in history]
    assert skipped[0] and not skipped[-1]  # 2^24 overflows fp16; the scale comes down
    weights = [None] + [h["weights"] for h in history]
    for i, h in enumerate(history):
        nxt = history[i + 1]["loss_scale"] if i + 1 < len(history) else None
        if h["skipped"]:
            assert math.isnan(h["grad_norm"])
            if weights[i] is not None:
                assert h["weights"] == weights[i]  # the step was not taken
            if nxt is not None:
                assert nxt == h["loss_scale"] / 2
        elif nxt is not None:
            assert nxt == h["loss_scale"]  # grows only after --loss-scale-window good steps
    assert history[-1]["loss"] < history[0]["loss"]


def test_static_scale_follows_the_fp32_curve_on_every_rank():
    fp32 = launch(tw.train, 1, timeout=300)[0]
    for history in launch(
        _train, 2, dict(fp16=True, loss_scale=1024.0, tensor_model_parallel_size=2),
        timeout=300,
    ):  # fmt: skip
        assert [h["skipped"] for h in history] == [False] * 3
        assert [h["loss_scale"] for h in history] == [1024.0] * 3
        for h, r in zip(history, fp32, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=2e-3)


def _train(kw):
    return tw.train(**kw)


def test_fp16_and_bf16_together_are_refused():
    with pytest.raises(ConfigError, match="--bf16 and --fp16 exclude each other"):
        tw.tiny(fp16=True, bf16=True).check(1)
