"""The trainer: every parallel layout gives the single-process loss curve; scatter/gather cuts
pipeline bytes by t; bad layouts are refused before any work; `megart train` as users run it."""

import json
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch


@pytest.fixture(scope="module")
def reference():
    return launch(tw.train, 1, timeout=300)[0]


def same_curve(history, reference, rtol=1e-5):
    assert [h["iteration"] for h in history] == [1, 2, 3]
    for h, r in zip(history, reference, strict=True):
        assert h["loss"] == pytest.approx(r["loss"], rel=rtol)
        assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)


LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2-sequence-parallel": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "pp2-interleaved": (
        2,
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),
    "dp2": (2, {}),
    "tp2-pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "tp2-dp2": (4, dict(tensor_model_parallel_size=2)),
    "pp2-dp2": (4, dict(pipeline_model_parallel_size=2)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_follows_the_single_process_loss_curve(name, reference):
    nproc, kw = LAYOUTS[name]
    for history in launch(_train_with, nproc, kw, timeout=300):
        same_curve(history, reference)


def _train_with(kw):
    return tw.train(**kw)


# --distributed-backend torch: megart's communication through torch.distributed (gloo here), an
# implementation independent of megart's transports, on the same curve.
OVER_TORCH = ["tp2", "pp2", "dp2", "tp2-pp2"]


@pytest.mark.parametrize("name", OVER_TORCH)
def test_layout_over_torch_distributed_follows_the_single_process_loss_curve(name, reference):
    nproc, kw = LAYOUTS[name]
    for history, backend in launch(_train_over_torch, nproc, kw, timeout=300):
        assert backend == "gloo"  # it did go through torch.distributed
        same_curve(history, reference)


def _train_over_torch(kw):
    import torch.distributed as td

    return tw.train(distributed_backend="torch", **kw), td.get_backend()


@pytest.mark.slow
def test_tp2_pp2_dp2_on_eight_ranks(reference):
    kw = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    for history in launch(_train_with, 8, kw, timeout=600):
        same_curve(history, reference)


def test_scatter_gather_halves_pipeline_bytes_at_tp2(reference):
    kw = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    on = launch(_train_with, 4, kw, timeout=300)[0]
    off = launch(_train_with, 4, {**kw, "scatter_gather_tensors_in_pipeline": False}, timeout=300)[
        0
    ]
    same_curve(on, reference)
    same_curve(off, reference)
    for a, b in zip(on, off, strict=True):
        # m = 4 microbatches, each an activation and a gradient of s x b x h float32, sent by
        # both tensor-parallel ranks: 2 * 4 * 2 * (16 * 2 * 32 * 4) bytes without slicing.
        assert b["pipeline_p2p_bytes"] == 2 * 4 * 2 * 16 * 2 * 32 * 4
        assert a["pipeline_p2p_bytes"] * 2 == b["pipeline_p2p_bytes"]


@pytest.mark.parametrize(
    "kw, world, message",
    [
        (
            dict(global_batch_size=10),
            2,
            "--global-batch-size 10 is not divisible by --micro-batch-size 2 x data-parallel "
            "size 2 = 4; use a global batch of 8 or 12",
        ),
        (
            dict(
                pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=1,
                global_batch_size=6,
            ),
            2,
            "needs the number of microbatches (3 = global batch 6 / (micro batch 2 x data-parallel "
            "1)) to be a multiple of the pipeline size (2); use a global batch of 4 or 8",
        ),
        (dict(tensor_model_parallel_size=3), 4, "do not split into tensor-parallel 3"),
        (dict(pipeline_model_parallel_size=3), 3, "--num-layers 4 is not divisible by"),
    ],
)
def test_wrong_layouts_are_refused_with_numbers(kw, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tw.tiny(**kw).check(world)


def test_fewer_microbatches_than_stages_get_one_batch_to_use():
    # Two microbatches on four interleaved stages: the only batch to suggest is the one above
    # (the message once offered "8 or 8").
    cfg = tw.tiny(
        pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1, global_batch_size=4
    )
    with pytest.raises(ConfigError) as refused:
        cfg.check(4)
    assert str(refused.value).endswith("pipeline size (4); use a global batch of 8")


def megart(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "megart", *args], capture_output=True, text=True, timeout=600, **kw
    )


def test_megart_train_runs_on_its_default_and_logs_jsonl(tmp_path):
    log = tmp_path / "log.jsonl"
    out = megart("train", "--train-iters", "3", "--log-jsonl", str(log))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("megart train: GPT 4 layers x 128 hidden")
    # On CPU: throughput per process, without the GPU wording (TFLOP/s per GPU, MFU).
    assert "tokens/s" in lines[-4] and "GFLOP/s per process (CPU)" in lines[-4]
    assert "per GPU" not in lines[-4] and "MFU" not in lines[-4]
    # The default evaluates after the last iteration, and the test range then, as Megatron.
    assert lines[-3].startswith("validation loss at iteration 3 | lm loss value: ")
    assert lines[-2].startswith("validation loss at the end of training for test data | ")
    # The summary: the warm-up iterations are left out of the means.
    assert lines[-1].startswith("megart train: done: 3 iterations (to 3) in ")
    assert "mean over iterations 3-3 (2 warm-up iterations excluded): " in lines[-1]
    assert "validation loss " in lines[-1] and f"log in {log}" in lines[-1]
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[-1]["valid_loss"] > 0 and rows[-1]["test_loss"] > 0
    for r in rows:
        for key in (
            "loss",
            "grad_norm",
            "lr",
            "tokens_per_s",
            "tflops_per_gpu",
            "pipeline_p2p_bytes",
        ):
            assert key in r
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_megart_train_refuses_a_bad_layout_before_any_work():
    out = megart("train", "--global-batch-size", "6", "--micro-batch-size", "4")
    assert out.returncode == 2
    assert "use a global batch of 4 or 8" in out.stderr
    assert "iteration" not in out.stdout


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_launches_megart_train(tmp_path):
    log = tmp_path / "log.jsonl"
    out = subprocess.run(
        [
            "torchrun",
            "--nproc-per-node",
            "2",
            "-m",
            "megart",
            "train",
            "--pipeline-model-parallel-size",
            "2",
            "--train-iters",
            "2",
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--seq-length",
            "32",
            "--log-jsonl",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(rows) == 2 and all(r["pipeline_p2p_bytes"] > 0 for r in rows)


def _grads(kw):
    return tw.gradients_after_one_step(**kw)


def test_gradients_after_one_step_equal_the_single_process_ones():
    import torch

    reference = launch(_grads, 1, {}, timeout=300)[0]
    kw = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    seen = set()
    for grads in launch(_grads, 4, kw, timeout=300):
        for name, g in grads.items():
            torch.testing.assert_close(g, reference[name], rtol=1e-4, atol=1e-7, msg=name)
            seen.add(name)
    assert seen == set(reference)


@st.composite
def small_layouts(draw):
    tp, pp, dp = draw(
        st.sampled_from(
            [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2)]
        )
    )
    kw = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    micro = draw(st.sampled_from([1, 2]))
    m = draw(st.sampled_from([2, 4]))
    kw.update(micro_batch_size=micro, global_batch_size=micro * dp * m)
    if pp > 1 and draw(st.booleans()):
        kw["num_layers_per_virtual_pipeline_stage"] = 1
    if tp > 1:
        kw["sequence_parallel"] = draw(st.booleans())
    return tp * pp * dp, kw


@settings(max_examples=4, deadline=None)
@given(small_layouts())
def test_random_small_layouts_and_schedules_follow_one_process(case):
    nproc, kw = case
    batch = {k: kw[k] for k in ("micro_batch_size", "global_batch_size")}
    reference = launch(_train_with, 1, {**batch, "train_iters": 2}, timeout=300)[0]
    for history in launch(_train_with, nproc, {**kw, "train_iters": 2}, timeout=300):
        for h, r in zip(history, reference, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)


def test_every_train_flag_has_help():
    import dataclasses

    from megart.cli.train import HELP
    from megart.training.config import TrainConfig

    assert set(HELP) == {f.name for f in dataclasses.fields(TrainConfig)}
    text = " ".join(megart("train", "--help").stdout.split())  # argparse wraps lines
    assert "--eval-iters EVAL_ITERS global batches per evaluation (0: no evaluation)" in text
    assert "the built-in corpus (the Python standard library's sources, as bytes)" in text
