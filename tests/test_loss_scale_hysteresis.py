"""--hysteresis: megart's LossScaler against Megatron-Core's DynamicGradScaler (megatron-core
0.16.1, CPU) step by step over drawn overflow sequences, its state dict (older states without a
tracker), and the flag's way from the command line to the scaler."""

import argparse
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import megatron_core_workers as mcw
import megatron_optim_workers as mow
import megatron_workers as mw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.optim import LossScaler


def _megatron_scaler(init: float, least: float, interval: int, hysteresis: int):
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    with mow._cuda_named():  # its scalars are made on "cuda": the CPU here
        return DynamicGradScaler(
            initial_scale=init, min_scale=least, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=interval, hysteresis=hysteresis,
        )  # fmt: skip


def _state(scaler) -> tuple[float, int, int]:
    s = scaler.state_dict()
    return float(s["scale"]), int(s["growth_tracker"]), int(s["hysteresis_tracker"])


@given(
    hysteresis=st.integers(1, 4),
    interval=st.integers(1, 5),
    # Powers of two: both sides' scales are then exact (Megatron's is a float32 tensor).
    init_exp=st.integers(0, 12),
    floor_exp=st.integers(0, 12),
    overflows=st.lists(st.booleans(), min_size=1, max_size=60),
    handover=st.integers(0, 60),
)
def test_scale_and_trackers_are_megatron_cores_after_every_step(
    hysteresis, interval, init_exp, floor_exp, overflows, handover
):
    """After every step the scale, the growth tracker and the hysteresis tracker are
    Megatron-Core's; at step ``handover`` megart's state dict is loaded into a second Megatron
    scaler (as a resumed run would be), which then keeps step with megart's too."""
    init, least = 2.0**init_exp, 2.0 ** min(floor_exp, init_exp)  # Megatron: floor <= start
    ours = LossScaler(init_scale=init, min_scale=least, growth_interval=interval,
                      hysteresis=hysteresis)  # fmt: skip
    theirs = [_megatron_scaler(init, least, interval, hysteresis)]
    for i, overflow in enumerate(overflows):
        if i == handover:
            # Another start (the load replaces it), the run's other settings.
            resumed = _megatron_scaler(2.0**20, least, interval, hysteresis)
            state = ours.state_dict()
            # It moves the loaded scale to the current CUDA device: the CPU here.
            with mcw.cuda_stays_on_cpu(), mock.patch("torch.cuda.current_device", lambda: "cpu"):
                resumed.load_state_dict(
                    {"scale": torch.tensor([state["scale"]]),
                     "growth_tracker": state["good_steps"],
                     "hysteresis_tracker": state["hysteresis_tracker"]}
                )  # fmt: skip
            theirs.append(resumed)
        ours.update(overflow)
        for t in theirs:
            t.update(overflow)
            assert (ours.scale, ours.state_dict()["good_steps"], ours.hysteresis_tracker) == (
                _state(t)
            ), (i, overflows[: i + 1])


def test_overflows_far_apart_still_add_up_between_growths():
    """Megatron's semantics, by hand: a good step restores no tolerance, a growth does."""
    s = LossScaler(init_scale=1024.0, growth_interval=3, hysteresis=2)
    for overflow, scale in [(True, 1024), (False, 1024), (True, 512), (True, 256)]:
        s.update(overflow)
        assert s.scale == scale
    for _ in range(3):
        s.update(False)
    assert (s.scale, s.hysteresis_tracker) == (512.0, 2)  # grown, tolerance restored
    s.update(True)
    assert s.scale == 512.0


def test_state_dict_round_trips_and_an_older_state_starts_a_fresh_tracker():
    s = LossScaler(init_scale=64.0, hysteresis=3)
    s.update(True)
    state = s.state_dict()
    assert state == {"scale": 64.0, "good_steps": 0, "hysteresis_tracker": 2}
    other = LossScaler(hysteresis=3)
    other.load_state_dict(state)
    assert other.state_dict() == state
    other.load_state_dict({"scale": 32.0, "good_steps": 5})  # written before --hysteresis
    assert other.state_dict() == {"scale": 32.0, "good_steps": 5, "hysteresis_tracker": 3}


def test_a_hysteresis_below_one_is_refused():
    with pytest.raises(ConfigError, match="hysteresis 0: .* at least 1"):
        LossScaler(hysteresis=0)
    with pytest.raises(ConfigError, match="--hysteresis 0: .* at least 1"):
        tw.tiny(fp16=True, hysteresis=0).check(1)
    tw.tiny(hysteresis=0).check(1)  # without --fp16 ignored, as the other loss-scale flags
    # A static --loss-scale never uses it: Megatron-Core builds a ConstantGradScaler then and
    # checks only the scale, so Megatron-LM takes these flags; so does megart's check.
    tw.tiny(fp16=True, loss_scale=1024.0, hysteresis=0, loss_scale_window=0).check(1)
    status, out = mw.run_cli(["--fp16", "--hysteresis", "0"])
    assert status == 2 and "--hysteresis 0" in out and "iteration" not in out


def test_a_static_scale_trains_with_hysteresis_zero():
    """A static --loss-scale never updates, so --hysteresis 0 (which Megatron's constant
    scaler never reads) does not stop it."""
    kw = dict(fp16=True, loss_scale=1024.0, hysteresis=0, train_iters=2)
    history = launch(tw.train_kw, 1, kw, timeout=300)[0]
    assert [h["loss_scale"] for h in history] == [1024.0, 1024.0]


def test_the_flag_reaches_the_config_with_megatrons_default():
    from megart.cli.train import add_arguments, config_from_args

    def parse(*argv: str):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return config_from_args(p.parse_args(list(argv)))

    assert parse().hysteresis == 2
    assert parse("--fp16", "--hysteresis", "3").hysteresis == 3


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(loss_scale_window=0), "--loss-scale-window 0: .* at least 1"),
        (dict(initial_loss_scale=0.0), "--initial-loss-scale 0 must be positive"),
        (dict(min_loss_scale=-1.0), "--min-loss-scale -1 must be positive"),
        (dict(loss_scale=-1.0), "--loss-scale -1 must be positive"),
    ],
)
def test_the_other_loss_scale_flags_are_refused_by_name(flags, message):
    with pytest.raises(ConfigError, match=message):
        tw.tiny(fp16=True, **flags).check(1)
    tw.tiny(**flags).check(1)  # without --fp16 ignored


def test_loss_scale_0_is_the_dynamic_scale_as_in_megatron():
    """Megatron-LM builds its dynamic scaler unless --loss-scale is truthy."""
    assert tw.tiny(fp16=True, loss_scale=0.0).loss_scale is None
    assert tw.tiny(fp16=True, loss_scale=1024.0).loss_scale == 1024.0
