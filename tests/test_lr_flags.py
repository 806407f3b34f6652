"""Megatron-LM's learning-rate flags in megart train: each --lr-decay-style (WSD with its
anneal too) and --lr-warmup-fraction against Megatron-Core's own OptimizerParamScheduler, the
endpoints of each style, and the flags reaching the schedule or refused where they do nothing.
(Moved from test_trainer_flags.py, which keeps the architecture flags.)"""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.training.lr import LR_DECAY_STYLES, WSD_DECAY_STYLES, learning_rate
from megatron_workers import megatron_rate
from test_trainer_flags import parse


@settings(max_examples=400, deadline=None)
@given(
    style=st.sampled_from(LR_DECAY_STYLES),
    warmup=st.one_of(st.integers(0, 40), st.floats(0.1, 40)),
    span=st.floats(0.5, 200),
    at=st.floats(0, 1.3),
    lr=st.floats(1e-5, 1.0),
    floor=st.floats(0, 1),
    init=st.sampled_from([0.0, 0.1, 1.0]),
    # WSD's anneal: a share of the decay, past it (into warm-up) too, or none at all
    anneal=st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.5]),
    anneal_style=st.sampled_from(WSD_DECAY_STYLES),
)
def test_every_decay_style_is_megatron_cores(
    style, warmup, span, at, lr, floor, init, anneal, anneal_style
):
    decay = warmup + span
    i = int(at * (decay + 2))
    min_lr = lr * floor
    wsd = (anneal * span, anneal_style) if style == "WSD" else (None, "exponential")
    got = learning_rate(i, lr, min_lr, warmup, decay, style, init * lr, 1.0, *wsd)
    want = megatron_rate(i, lr, min_lr, warmup, decay, style, init * lr, *wsd)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert 0 <= got <= lr * (1 + 1e-12)
    assert i <= warmup or got >= min_lr  # the floor, once warm-up is over


@pytest.mark.parametrize("style", [s for s in LR_DECAY_STYLES if s != "WSD"])
def test_every_decay_style_reaches_its_endpoints(style):
    lr, min_lr, w, d = 2.0, 0.2, 10, 110
    lrs = [learning_rate(i, lr, min_lr, w, d, style) for i in range(140)]
    assert lrs[0] == 0.0  # Megatron's warm-up starts at --lr-warmup-init, 0
    assert all(a < b for a, b in zip(lrs[:w], lrs[1 : w + 1], strict=True))  # warming up
    assert lrs[w - 1] == pytest.approx(lr * (w - 1) / w) and lrs[w] == pytest.approx(lr)
    after = lrs[w:]
    if style == "constant":
        assert after == [lr] * len(after)  # past --lr-decay-iters too, as Megatron
        return
    assert all(a >= b for a, b in zip(after, after[1:], strict=False))
    assert lrs[d + 1 :] == [min_lr] * (len(lrs) - d - 1)
    if style == "inverse-square-root":
        # Megatron's: lr sqrt(W / n) down to n = D, then the floor.
        assert lrs[40] == pytest.approx(lr * math.sqrt(w / 40))
        assert lrs[d] == pytest.approx(max(min_lr, lr * math.sqrt(w / d)))
    else:
        assert lrs[d] == min_lr
        middle = {"linear": (lr + min_lr) / 2, "cosine": (lr + min_lr) / 2}[style]
        assert lrs[(w + d) // 2] == pytest.approx(middle)
        quarter = lrs[w + (d - w) // 4]
        assert quarter == pytest.approx(
            min_lr + (lr - min_lr) * (0.75 if style == "linear" else (1 + math.sqrt(0.5)) / 2)
        )


@pytest.mark.parametrize("anneal_style", WSD_DECAY_STYLES)
def test_wsd_holds_the_peak_then_anneals_to_the_floor(anneal_style):
    """Warm-up, stable at --lr, then the last A iterations of the decay fall to --min-lr, the
    share a of the anneal done giving each shape's coefficient (1 at a = 0, 0 at a = 1)."""
    lr, min_lr, w, d, a = 2.0, 0.2, 10, 110, 40
    lrs = [learning_rate(i, lr, min_lr, w, d, "WSD", 0.0, 1.0, a, anneal_style) for i in range(140)]
    assert lrs[w - 1] == pytest.approx(lr * (w - 1) / w)  # warm-up as the other styles'
    assert lrs[w : d - a + 1] == [lr] * (d - a + 1 - w)  # stable up to the anneal's start
    falling = lrs[d - a :]
    assert all(x > y for x, y in zip(falling[:a], falling[1 : a + 1], strict=True))
    assert lrs[d] == pytest.approx(min_lr) and lrs[d + 1 :] == [min_lr] * (len(lrs) - d - 1)
    half = {"exponential": math.sqrt(2) - 1, "linear": 0.5, "cosine": 0.5,
            "minus_sqrt": 1 - math.sqrt(0.5)}[anneal_style]  # fmt: skip
    assert lrs[d - a // 2] == pytest.approx(min_lr + half * (lr - min_lr))


def test_wsd_flags_reach_the_schedule_and_are_refused_where_they_do_nothing():
    c = parse("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10",
              "--lr-wsd-decay-style", "linear", "--train-iters", "40")  # fmt: skip
    c.check(1)
    assert [c.learning_rate(i) for i in (29, 30, 35, 40)] == pytest.approx(
        [c.lr, c.lr, c.lr / 2, 0.0]
    )
    by_samples = tw.tiny(lr_decay_style="WSD", train_samples=640, global_batch_size=16,
                         lr_wsd_decay_samples=160, lr_warmup_iters=0)  # fmt: skip
    by_samples.check(1)
    assert by_samples.anneal_iters == 10
    for flags, message in [
        (["--lr-decay-style", "WSD"], r"give its length, --lr-wsd-decay-iters \(Megatron-LM"),
        (["--lr-wsd-decay-iters", "5"], "--lr-wsd-decay-iters 5 shape the anneal of "
         "--lr-decay-style WSD, and do nothing under --lr-decay-style linear"),
        (["--lr-wsd-decay-style", "cosine", "--lr-decay-style", "cosine"],
         "--lr-wsd-decay-style cosine shape the anneal"),
        (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "-1"], "an anneal lasts 0 or more"),
        (["--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "64"],
         "--lr-wsd-decay-samples with --train-iters: as in Megatron-LM"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            parse(*flags).check(1)
    with pytest.raises(ConfigError, match="--lr-wsd-decay-iters with --train-samples"):
        dataclasses.replace(by_samples, lr_wsd_decay_samples=None, lr_wsd_decay_iters=3).check(1)


def test_lr_flags_reach_the_schedule_and_the_default_is_megatrons():
    default = parse()  # Megatron-LM's: linear, no warm-up, down to --min-lr 0
    assert (default.lr_decay_style, default.warmup_iters, default.decay_iters) == ("linear", 0, 40)
    assert (default.learning_rate(0), default.learning_rate(40)) == (default.lr, 0.0)
    c = parse("--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "50")
    assert (c.lr_decay_style, c.warmup_iters) == ("cosine", 5.0)
    explicit = parse(
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--lr-decay-iters", "50"
    )
    assert [c.learning_rate(i) for i in range(60)] == [explicit.learning_rate(i) for i in range(60)]
    # --lr-warmup-iters 0 is no warm-up, so it goes with a fraction.
    assert parse("--lr-warmup-iters", "0", "--lr-warmup-fraction", "0.2").warmup_iters == 8.0
