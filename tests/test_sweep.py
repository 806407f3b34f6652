"""A few of tests/sweep.py's random combinations in every run of the suite (the sweep itself runs
longer, by hand): a drawn layout, model variant and flags that megart train accepts follows the
one-process loss curve, under 16-bit flags too, and resumes in another layout from a store
written in one. A refusal is a verdict too (a batch or layer count the layout cannot take);
an error or a mismatch fails."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sweep


@pytest.mark.parametrize("mode", sorted(sweep.TOLERANCE))
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_drawn_combination_follows_the_one_process_curve(mode, seed):
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
