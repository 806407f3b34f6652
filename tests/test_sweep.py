"""A few of tests/sweep.py's random combinations in every run of the suite (the sweep itself runs
longer, by hand): a drawn layout, model variant and flags that megart train accepts follows the
one-process loss curve, under 16-bit flags too, resumes in another layout from a store
written in one, goes through Hugging Face's format and back (sweep_hf) and through
convert-checkpoint (sweep_convert). A refusal is a verdict too (a batch or layer count the
layout cannot take); an error or a mismatch fails."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sweep
import sweep_hf


@pytest.mark.parametrize("mode", sorted(sweep.TOLERANCE))
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_drawn_combination_follows_the_one_process_curve(mode, seed):
    if mode.startswith("hf"):
        pytest.importorskip("transformers")
    verdict = sweep.one(random.Random(seed), mode)
    assert verdict.startswith(("OK", "REFUSED", "SKIP")), verdict


def test_the_verdict_catches_a_run_off_the_curve():
    # The check itself: one loss off by more than the mode's tolerance, on any rank, is a
    # mismatch; within it, OK.
    straight = [{"loss": 5.0}, {"loss": 4.0}]
    on = [[{"loss": 5.0}, {"loss": 4.0 * (1 + 1e-7)}]] * 2
    assert sweep.judge(on, straight, "curves").startswith("OK")
    off = [on[0], [{"loss": 5.0}, {"loss": 4.0 * (1 + 1e-4)}]]
    assert sweep.judge(off, straight, "curves").startswith("MISMATCH")
    assert sweep.judge(off, straight, "precision").startswith("OK")


def test_the_logits_check_catches_a_model_off_by_a_step():
    # sweep_hf's: logits moved by 1e-4 of the largest are a mismatch, a layout's reordered
    # sums (1e-7) are not.
    want = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    assert sweep_hf.apart(want * (1 + 1e-7), want) < sweep_hf.LOGITS
    assert sweep_hf.apart(want + 1e-4 * want.abs().max(), want) > sweep_hf.LOGITS
