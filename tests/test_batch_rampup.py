"""--rampup-batch-size as Megatron-LM runs it: each iteration's global batch and microbatch
count are Megatron-Core's own calculator's of the consumed samples; a pp2 x dp2 ramp gives the
one-process curve and gradients, each the gradient of the whole global batch's mean loss, and
so does every pipeline schedule (one schedule per microbatch count); the
learning rate is Megatron's scheduler stepped by each batch; a resume mid-ramp continues the
same curve; values that cannot run are refused by name before any work."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

import megatron_workers as mw
import rampup_workers as rw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.training import batch_rampup, checkpoint


def megatron_batches(config, dp, iterations):
    """(global batch, microbatches) of each iteration, from Megatron-Core's calculator updated
    with the consumed samples as Megatron's training loop does."""
    start, increment, samples = config.rampup_batch_size
    calc = RampupBatchsizeNumMicroBatchesCalculator(
        config.global_batch_size, config.micro_batch_size, dp, False, 1, start, increment, samples
    )
    consumed, out = 0, []
    for _ in range(iterations):
        calc.update(consumed, consistency_check=True)
        out.append((calc.get_current_global_batch_size(), calc.get()))
        consumed += calc.get_current_global_batch_size()
    return out


def megatron_train_iters(config):
    """Megatron-LM's update_train_iters with a ramp (training.py), on Megatron-Core's
    calculator."""
    start, increment, samples = config.rampup_batch_size
    calc = RampupBatchsizeNumMicroBatchesCalculator(
        config.global_batch_size, 1, 1, False, 1, start, increment, samples
    )
    iterations = consumed = 0
    while consumed <= samples and consumed <= config.train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    if config.train_samples > consumed:
        iterations += (config.train_samples - consumed) // config.global_batch_size
    return iterations


@st.composite
def ramps(draw):
    q = draw(st.sampled_from([1, 2, 3, 4, 8]))  # micro batch x data-parallel size
    start = q * draw(st.integers(1, 8))
    increment = q * draw(st.integers(1, 8))
    gbs = start + increment * draw(st.integers(1, 12))
    samples = draw(st.integers(1, 2000))
    return q, gbs, [start, increment, samples]


@settings(max_examples=200, deadline=None)
@given(ramps(), st.integers(1, 5000))
def test_batches_and_iterations_are_megatron_cores(ramp, train_samples):
    q, gbs, values = ramp
    for mbs, dp in {(q, 1), (1, q)}:
        c = tw.tiny(global_batch_size=gbs, micro_batch_size=mbs, rampup_batch_size=values)
        consumed, ours = 0, []
        for _ in range(60):
            batch = batch_rampup.batch_size(c, consumed)
            ours.append((batch, batch // (mbs * dp)))
            consumed += batch
        assert ours == megatron_batches(c, dp, 60)
    c = tw.tiny(global_batch_size=gbs, rampup_batch_size=values, train_samples=train_samples,
                train_iters=None, lr_warmup_iters=0)  # fmt: skip
    assert c.train_iters == megatron_train_iters(c)


# The ramp 4, 8, 12, 16 (4 samples per microbatch step at dp2) over 24 samples: every
# iteration of the ramp has its own microbatch count; no clipping, so gradients compare as
# they are; two iterations of warm-up, counted in samples as Megatron's scheduler counts them.
RAMP = dict(
    rampup_batch_size=[4, 4, 24], global_batch_size=16, micro_batch_size=2, train_iters=6,
    clip_grad=0.0, lr_warmup_iters=2, lr_decay_iters=5, lr_decay_style="cosine",
)  # fmt: skip


def megatron_learning_rates(config, batches):
    """Megatron-Core's OptimizerParamScheduler under --train-iters: counted in samples
    (--lr-decay-iters x --global-batch-size), stepped by each iteration's batch."""
    scheduler, rate = mw.megatron_scheduler(
        config.lr, config.min_lr, config.lr_warmup_iters * config.global_batch_size,
        config.lr_decay_iters * config.global_batch_size, config.lr_decay_style,
    )  # fmt: skip
    rates = []
    for batch in batches:
        rates.append(rate())
        scheduler.step(batch)
    return rates


def test_pp2_dp2_ramp_equals_one_process_and_the_whole_batch_gradient():
    import torch

    reference = launch(rw.whole_batch_reference, 1, RAMP, timeout=300, env=tw.ONE_THREAD)[0]
    want = megatron_batches(tw.tiny(**RAMP), 2, 6)
    assert [b for b, _ in want] == [4, 4, 8, 12, 16, 16]  # the ramp runs, then the full batch
    one = [r["figures"] for r in reference]
    assert [(f["global_batch_size"], f["microbatches"]) for f in one] == [
        (b, 2 * m) for b, m in want
    ]
    for r in reference:  # the mean over microbatches is the whole batch's mean
        assert r["figures"]["loss"] == pytest.approx(r["loss"], rel=1e-6)
        for name, g in r["grads"].items():
            torch.testing.assert_close(r["trainer_grads"][name], g, rtol=1e-4, atol=1e-7)
    lrs = megatron_learning_rates(tw.tiny(**RAMP), [f["global_batch_size"] for f in one])
    assert [f["lr"] for f in one] == pytest.approx(lrs, rel=1e-12)
    layout = dict(RAMP, pipeline_model_parallel_size=2)
    for steps in launch(rw.steps_with_grads, 4, layout, timeout=300):
        figures = [s["figures"] for s in steps]
        assert [(f["global_batch_size"], f["microbatches"]) for f in figures] == want
        assert [f["consumed_samples"] for f in figures] == [4, 8, 16, 28, 44, 60]
        for f, r in zip(figures, one, strict=True):
            assert f["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert f["lr"] == r["lr"]
        for s, r in zip(steps, reference, strict=True):
            for name, g in s["grads"].items():
                torch.testing.assert_close(g, r["trainer_grads"][name], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "schedule",
    [
        dict(num_layers_per_virtual_pipeline_stage=1, rampup_batch_size=[4, 4, 24]),
        dict(pipeline_schedule="zb-h1", rampup_batch_size=[2, 2, 24]),
        dict(pipeline_schedule="zb-v", rampup_batch_size=[8, 8, 24]),
    ],
    ids=["interleaved", "zb-h1", "zb-v"],
)
def test_every_pipeline_schedule_runs_the_ramp_on_the_one_process_curve(schedule):
    kw = dict(RAMP, **schedule)
    reference = launch(tw.train_kw, 1, {k: v for k, v in kw.items() if "pipeline" not in k},
                       timeout=300)[0]  # fmt: skip
    assert len({h["microbatches"] for h in reference}) > 1  # the count does change
    history = launch(tw.train_kw, 2, dict(kw, pipeline_model_parallel_size=2), timeout=300)[0]
    for h, r in zip(history, reference, strict=True):
        assert (h["global_batch_size"], h["microbatches"]) == (
            r["global_batch_size"], r["microbatches"],
        )  # fmt: skip
        assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)


def test_resume_mid_ramp_continues_the_same_curve(tmp_path):
    layout = dict(RAMP, pipeline_model_parallel_size=2, hidden_dropout=0.1)
    straight = launch(tw.train_kw, 2, layout, timeout=300)[0]
    first = launch(tw.train_kw, 2, dict(layout, train_iters=3, save=str(tmp_path)), timeout=300)[0]
    # Megatron's rule: a checkpoint before each change of the batch (after iterations 2 and
    # 3), and at the end; the resumed run continues from the third's consumed samples.
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    state = checkpoint.read_file(tmp_path / "iter_0000003" / "mp_rank_00_000" / checkpoint.FILE)
    assert state["consumed_train_samples"] == 16
    resumed = launch(tw.train_kw, 2, dict(layout, load=str(tmp_path)), timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [4, 5, 6]
    for a, b in zip(straight, first + resumed, strict=True):
        assert (b["global_batch_size"], b["consumed_samples"]) == (
            a["global_batch_size"], a["consumed_samples"],
        )  # fmt: skip
        assert b["loss"] == pytest.approx(a["loss"], **tw.SAME_RUN)
        assert b["lr"] == pytest.approx(a["lr"], **tw.SAME_RUN)


@pytest.mark.parametrize(
    "flags, world, match",
    [
        (dict(rampup_batch_size=[0, 4, 10]), 1, "must be at least 1"),
        (dict(rampup_batch_size=[8, 4, 10]), 1, "start batch must be below --global-batch-size 8"),
        (dict(rampup_batch_size=[2, 4, 10]), 1, "8 - start 2 = 6 is not a multiple of the incr"),
        (dict(rampup_batch_size=[2, 2, 10]), 2, "multiples of --micro-batch-size 2 x data-parall"),
        (
            dict(rampup_batch_size=[2, 2, 10], global_batch_size=16,
                 pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
            2,
            "interleaved schedule needs every iteration's number of microbatches",
        ),
        (
            dict(rampup_batch_size=[4, 4, 10], global_batch_size=16,
                 pipeline_model_parallel_size=2, pipeline_schedule="zb-v"),
            2,
            "zb-v needs at least 2 x pipeline size = 4 microbatches, but the ramp's first",
        ),
    ],
)  # fmt: skip
def test_ramps_that_cannot_run_are_refused_by_name(flags, world, match):
    with pytest.raises(ConfigError, match=match) as e:
        tw.tiny(**flags).check(world)
    assert "--rampup-batch-size" in str(e.value)


def test_the_cli_refuses_before_any_work_and_names_megatrons_flags_it_does_not_have():
    status, out = mw.run_cli(["--rampup-batch-size", "3", "4", "10", "--global-batch-size", "16"])
    assert status == 2 and "--rampup-batch-size 3 4 10" in out and "iteration" not in out
    assert out.count("error") == 1
    for flag in (["--decrease-batch-size-if-needed"], ["--step-batch-size-schedule", "0:16"]):
        status, out = mw.run_cli([*flag, "--rampup-batch-size", "4", "4", "10"])
        # Refused by name, with a reason (megart.training.megatron_refusals), never ignored.
        assert status == 2 and out.startswith(f"megart train: error: {flag[0]}: "), out
        assert "unrecognized" not in out and out.count("error") == 1
