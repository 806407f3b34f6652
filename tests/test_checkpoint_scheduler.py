"""--use-checkpoint-opt_param-scheduler (Megatron-LM's): a run resumed from a checkpoint in
Megatron's formats (or megart's, which records the same state) follows the learning-rate
schedule saved there, whatever its own flags say,
at the rates Megatron-Core's OptimizerParamScheduler gives once it has loaded that state; and
where the flag cannot take effect it is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

import megatron_optim_workers as mow
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.training.checkpoint_args import checkpoint_records
from megart.training.checkpoint_scheduler import schedule_flags, with_saved_schedule
from train_workers import SAME_RUN

# The run that saves: warm-up, cosine decay to --min-lr by iteration 6, weight decay.
SAVED = dict(train_iters=6, lr=2e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="cosine",
             weight_decay=0.05)  # fmt: skip
# The resumed run's own flags: another schedule altogether, and two iterations more.
OTHER = dict(train_iters=8, lr=5e-3, min_lr=0.0, lr_warmup_iters=0, lr_decay_style="linear",
             weight_decay=0.1)  # fmt: skip


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """Per format: the saving run's uninterrupted curve (checkpoints after iterations 3 and 6)
    and the run resumed from iteration 3's (--ckpt-step) under OTHER's flags with the flag."""
    out = {}
    for fmt in ("megart", "torch", "torch_dist"):
        ckpt = str(tmp_path_factory.mktemp(fmt))
        kw = dict(SAVED, save=ckpt, save_interval=3, ckpt_format=fmt)
        straight = launch(tw.train_kw, 1, kw, timeout=300)[0]
        resumed_kw = dict(OTHER, load=ckpt, ckpt_format=fmt, ckpt_step=3,
                          use_checkpoint_opt_param_scheduler=True)  # fmt: skip
        resumed = launch(tw.train_kw, 1, resumed_kw, timeout=300)[0]
        out[fmt] = dict(dir=ckpt, straight=straight, resumed=resumed)
    return out


@pytest.mark.parametrize("fmt", ["megart", "torch", "torch_dist"])
def test_a_resumed_run_follows_the_saved_schedule(saved_runs, fmt):
    r = saved_runs[fmt]
    resumed, straight = r["resumed"], r["straight"]
    assert [h["iteration"] for h in resumed] == [4, 5, 6, 7, 8]
    # Iterations 4-6: the saving run's own rates, and so its losses (its weight decay too).
    assert [h["lr"] for h in resumed[:3]] == pytest.approx([h["lr"] for h in straight[3:]])
    assert [h["loss"] for h in resumed[:3]] == pytest.approx(
        [h["loss"] for h in straight[3:]], **SAME_RUN
    )
    # Megatron-Core's scheduler, loaded from the saved state (not from megart's flags) and
    # stepped by the global batch each iteration, gives every resumed iteration's rate: past
    # the saved decay, the saved --min-lr, not the flags' 0.
    records, _, _ = checkpoint_records(r["dir"], 3)
    state = records.get("opt_param_scheduler") or records["scheduler"]  # megart's own record
    gbs = tw.tiny().global_batch_size
    states = [dict(state, num_steps=(h["iteration"] - 1) * gbs) for h in resumed]
    want = launch(mow.megatron_rates, 1, states, timeout=300)[0]
    assert [h["lr"] for h in resumed] == pytest.approx(want, rel=1e-12)
    assert resumed[-1]["lr"] == pytest.approx(SAVED["min_lr"])


def test_without_the_flag_the_changed_schedule_is_refused(saved_runs):
    with pytest.raises(Exception, match="--override-opt_param-scheduler"):
        launch(tw.train_kw, 1, dict(OTHER, load=saved_runs["torch"]["dir"], ckpt_format="torch",
                                    ckpt_step=3), timeout=300)  # fmt: skip


def _state(**kw: object) -> dict:
    base = dict(max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=16, lr_decay_steps=80,
                lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_style="constant",
                wd_incr_steps=80, num_steps=24)  # fmt: skip
    return {**base, **kw}


def test_saved_steps_become_this_runs_iterations_or_samples():
    """The scheduler's steps are samples: whole global batches become --lr-warmup-iters and
    --lr-decay-iters; under --train-samples they stay samples; a warm-up of no whole number
    (a --lr-warmup-fraction's) becomes the fraction of the decay it was. The rates that follow
    are the saved schedule's at every step."""
    config = tw.tiny(global_batch_size=8, train_iters=10)
    values = schedule_flags(_state(), config, "here")
    assert (values["lr_warmup_iters"], values["lr_decay_iters"]) == (2, 10)
    assert (values["lr"], values["min_lr"], values["weight_decay"]) == (1e-3, 1e-5, 0.1)
    taken = dataclasses.replace(config, **values)
    samples = dataclasses.replace(config, train_iters=None, train_samples=80)
    values = schedule_flags(_state(), samples, "here")
    assert (values["lr_warmup_samples"], values["lr_decay_samples"]) == (16, 80)
    by_samples = dataclasses.replace(samples, **values)
    fraction = schedule_flags(_state(lr_warmup_steps=13.5), config, "here")
    assert fraction["lr_warmup_fraction"] == 13.5 / 80 and fraction["lr_warmup_iters"] == 0
    by_fraction = dataclasses.replace(config, **fraction)
    states = [_state(num_steps=8 * i) for i in range(12)]
    states += [_state(lr_warmup_steps=13.5, num_steps=8 * i) for i in range(12)]
    want = launch(mow.megatron_rates, 1, states, timeout=300)[0]
    got = [taken.learning_rate(i) for i in range(12)]
    got += [by_fraction.learning_rate(i) for i in range(12)]
    assert got == pytest.approx(want, rel=1e-12)
    assert [by_samples.learning_rate(i) for i in range(12)] == pytest.approx(want[:12], rel=1e-12)


def test_a_saved_wsd_schedule_anneals_as_this_runs_flags_say():
    """Megatron's saved state says WSD but not how long its anneal is: Megatron-LM builds
    that from the flags, and so does megart; the rates are Megatron-Core's scheduler's, built
    with the anneal's flags and loaded from the state."""
    config = tw.tiny(global_batch_size=8, train_iters=10, use_checkpoint_opt_param_scheduler=True,
                     lr_wsd_decay_iters=4, lr_wsd_decay_style="cosine")  # fmt: skip
    taken = dataclasses.replace(config, **schedule_flags(_state(lr_decay_style="WSD"), config, ""))
    taken.check(1)
    assert taken.lr_decay_style == "WSD"
    states = [_state(lr_decay_style="WSD", num_steps=8 * i) for i in range(12)]
    want = launch(mow.megatron_rates, 1, states, 4 * 8, "cosine", timeout=300)[0]
    assert [taken.learning_rate(i) for i in range(12)] == pytest.approx(want, rel=1e-12)
    assert want[3] == want[6] == 1e-3 and 1e-5 < want[8] < want[7] < 1e-3  # stable, annealing


@pytest.mark.parametrize(
    "state,flags,match",
    [
        (
            _state(end_wd=0.2, wd_incr_style="linear"),
            {},
            "raises the weight decay over 80 samples and this run lasts 24; give --train-iters",
        ),
        (_state(lr_decay_steps=84), {}, "no whole number of this run's global batches of 8"),
        (
            _state(lr_decay_style="WSD"),
            {},
            "holds a WSD schedule, whose anneal length "
            "Megatron's scheduler state does not keep .*give --lr-wsd-decay-iters",
        ),
    ],
)
def test_a_saved_schedule_megart_cannot_follow_is_refused(state, flags, match):
    with pytest.raises(ConfigError, match=match):
        schedule_flags(state, tw.tiny(global_batch_size=8, **flags), "here")


@pytest.mark.parametrize(
    "flags,match",
    [
        (dict(override_opt_param_scheduler=True), "exclude each other"),
        (dict(finetune=True), "with --finetune: no scheduler state is loaded"),
        (dict(no_load_optim=True), "with --no-load-optim"),
    ],
)
def test_flags_that_leave_it_without_effect_are_refused(saved_runs, flags, match):
    config = tw.tiny(load=saved_runs["torch"]["dir"], use_checkpoint_opt_param_scheduler=True,
                     **flags)  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        with_saved_schedule(config)


def test_a_release_checkpoint_holds_no_schedule_to_take(tmp_path):
    """A release checkpoint (import-hf's, convert-checkpoint's: weights alone) loads as
    --finetune, with no scheduler: refused, naming what to give instead."""
    from megart.models import GPT
    from megart.training.checkpoint_save import write_release

    cfg = tw.tiny().gpt_config()
    weights = GPT(cfg).chunk.state_dict()
    write_release(tmp_path, cfg, weights, list(range(cfg.num_layers)))
    config = tw.tiny(load=str(tmp_path), use_checkpoint_opt_param_scheduler=True)
    with pytest.raises(ConfigError, match="holds no learning-rate scheduler state"):
        with_saved_schedule(config)


def test_a_restartable_jobs_first_run_starts_the_flags_schedule(tmp_path):
    """--load holding no checkpoint yet (the first run of a job that is restarted with the same
    command line) or a start from --pretrained-checkpoint: nothing resumed, the flags' schedule
    runs, as in Megatron-LM, which loads no scheduler then."""
    config = tw.tiny(load=str(tmp_path / "empty"), use_checkpoint_opt_param_scheduler=True)
    assert with_saved_schedule(config) is config
    with pytest.raises(ConfigError, match="give --load DIR"):
        with_saved_schedule(tw.tiny(use_checkpoint_opt_param_scheduler=True))


def test_the_decoupled_groups_bounds_come_from_the_saved_args(tmp_path):
    """--decoupled-lr's group (word embedding and output layer): Megatron-LM restores its
    bounds from the saved param groups, megart from the saved args, so a resumed run without
    the flag has the groups and the curve of the run that saved."""
    decoupled = dict(SAVED, decoupled_lr=5e-4, decoupled_min_lr=1e-5)
    kw = dict(decoupled, save=str(tmp_path), save_interval=3, ckpt_format="torch")
    straight = launch(tw.train_kw, 1, kw, timeout=300)[0]
    resumed_kw = dict(OTHER, load=str(tmp_path), ckpt_format="torch", ckpt_step=3,
                      use_checkpoint_opt_param_scheduler=True)  # fmt: skip
    resumed = launch(tw.train_kw, 1, resumed_kw, timeout=300)[0]
    assert [h["loss"] for h in resumed[:3]] == pytest.approx(
        [h["loss"] for h in straight[3:]], **SAME_RUN
    )
    # Without the saved bounds the embedding would step at the flags' --lr: another curve.
    plain = launch(tw.train_kw, 1, dict(SAVED, train_iters=6), timeout=300)[0]
    assert [h["loss"] for h in plain[3:]] != pytest.approx([h["loss"] for h in straight[3:]])


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_a_rising_weight_decay_is_taken_with_the_schedule(style):
    """A saved --weight-decay-incr-style linear or cosine becomes this run's (its span must be
    this run's: megart's rise spans --train-iters), and the decay each iteration is the one
    Megatron-Core's scheduler, loaded from the state, gives (get_wd)."""
    from megart.training.lr import weight_decay_rate

    config = tw.tiny(global_batch_size=8, train_iters=10)
    state = _state(start_wd=0.01, end_wd=0.2, wd_incr_style=style)
    taken = dataclasses.replace(config, **schedule_flags(state, config, "here"))
    assert (taken.start_weight_decay, taken.end_weight_decay) == (0.01, 0.2)
    assert taken.weight_decay_incr_style == style
    states = [dict(state, num_steps=8 * i) for i in range(12)]
    want = [wd for _, wd in launch(mow.megatron_rates_and_decays, 1, states, timeout=300)[0]]
    assert [weight_decay_rate(taken, i) for i in range(12)] == pytest.approx(want, rel=1e-12)
    assert len({round(w, 9) for w in want}) > 8  # a rise, not a constant
