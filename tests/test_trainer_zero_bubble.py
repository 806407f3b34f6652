"""`megart train --pipeline-schedule zb-h1 / zb-v`: every layout follows the single-process
loss curve (tensor, sequence and data parallelism, the distributed optimizer, recomputation,
fp16 and bf16), gradients after one step equal the reference, and bad combinations are refused
before any work."""

import pytest
import torch

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch


def _grads(kw):
    return tw.gradients_after_one_step(**kw)


@pytest.fixture(scope="module")
def reference():
    return launch(tw.train, 1, timeout=300)[0]


def same_curve(history, reference, rel=1e-5):
    assert [h["iteration"] for h in history] == [1, 2, 3]
    for h, r in zip(history, reference, strict=True):
        assert h["loss"] == pytest.approx(r["loss"], rel=rel)
        assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)


PP2 = dict(pipeline_model_parallel_size=2)
LAYOUTS = {
    "zb-h1-pp4": (4, dict(pipeline_model_parallel_size=4, pipeline_schedule="zb-h1")),
    "zb-h1-tp2-pp2-sp": (
        4,
        dict(PP2, pipeline_schedule="zb-h1", tensor_model_parallel_size=2, sequence_parallel=True),
    ),
    "zb-h1-pp2-dp2": (4, dict(PP2, pipeline_schedule="zb-h1")),
    "zb-v-pp2-recompute": (2, dict(PP2, pipeline_schedule="zb-v", recompute_granularity="full")),
    "zb-v-tp2-pp2": (4, dict(PP2, pipeline_schedule="zb-v", tensor_model_parallel_size=2)),
    # zb-v needs 2p = 4 microbatches: 8 sequences over dp2 in microbatches of 1.
    "zb-v-pp2-dp2-distopt": (
        4,
        dict(PP2, pipeline_schedule="zb-v", use_distributed_optimizer=True, micro_batch_size=1),
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_bubble_layouts_follow_the_single_process_loss_curve(name, reference):
    nproc, kw = LAYOUTS[name]
    for history in launch(tw.train_kw, nproc, kw, timeout=300):
        same_curve(history, reference)


def test_zb_v_on_four_stages_follows_one_process():
    # zb-v's V needs 2p chunks of layers and 2p microbatches: 8 layers, 8 microbatches.
    kw = dict(num_layers=8, global_batch_size=16, train_iters=2)
    one = launch(tw.train_kw, 1, kw, timeout=300)[0]
    for history in launch(
        tw.train_kw,
        4,
        dict(kw, pipeline_model_parallel_size=4, pipeline_schedule="zb-v"),
        timeout=300,
    ):
        for h, r in zip(history, one, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)


def test_gradients_after_one_step_equal_the_single_process_ones():
    reference = launch(_grads, 1, {}, timeout=300)[0]
    seen = set()
    for grads in launch(_grads, 2, dict(PP2, pipeline_schedule="zb-v"), timeout=300):
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name], rtol=1e-4, atol=1e-7, msg=name)
            seen.add(name)
    assert seen == set(reference)


@pytest.mark.parametrize(
    "precision",
    [
        dict(bf16=True, pipeline_schedule="zb-v"),
        dict(fp16=True, loss_scale=1024.0, pipeline_schedule="zb-h1"),
    ],
)
def test_half_precision_runs_and_follows_the_fp32_curve(precision, reference):
    # Autocast rounds differently from fp32, so the curve agrees to 2e-2, as test_trainer_fp16's.
    for history in launch(tw.train_kw, 2, dict(PP2, **precision), timeout=300):
        for h, r in zip(history, reference, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=2e-2)


@pytest.mark.parametrize(
    "kw, world, message",
    [
        (
            dict(PP2, pipeline_schedule="zb-v", global_batch_size=6),
            2,
            "zb-v needs at least 2 x pipeline size = 4 microbatches, got 3 (global batch 6 / "
            "(micro batch 2 x data-parallel 1)); use a global batch of at least 8, or zb-h1",
        ),
        (
            dict(pipeline_model_parallel_size=4, pipeline_schedule="zb-v"),
            4,
            "--num-layers 4 must be divisible by 2 x pipeline size 4; use a multiple of 8 layers",
        ),
        (
            dict(PP2, pipeline_schedule="zb-v", num_layers_per_virtual_pipeline_stage=1),
            2,
            "zb-v derives its two chunks from the layers per stage: leave out "
            "--num-layers-per-virtual-pipeline-stage 1",
        ),
        (
            dict(PP2, pipeline_schedule="zb-h1", num_layers_per_virtual_pipeline_stage=1),
            2,
            "zb-h1 runs one model chunk per rank",
        ),
        (
            dict(PP2, pipeline_schedule="interleaved"),
            2,
            "interleaved needs --num-layers-per-virtual-pipeline-stage",
        ),
        (dict(pipeline_schedule="gpipe"), 1, "--pipeline-schedule gpipe is not one of"),
    ],
)
def test_bad_combinations_are_refused_with_what_fits(kw, world, message):
    with pytest.raises(ConfigError) as e:
        tw.tiny(**kw).check(world)
    assert message in str(e.value)
