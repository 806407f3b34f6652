"""--fp16: fp16 compute under autocast with fp32 weights and loss scaling. A step whose
gradients overflow is skipped on every rank (weights unchanged) and the dynamic scale halves
at the --hysteresis-th overflow and each later one (Megatron's semantics); once the scale
fits, training proceeds and follows the fp32 curve closely."""

import math
import shutil

import pytest
import torch

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from train_workers import SAME_RUN


@pytest.mark.parametrize("hysteresis", [None, 1, 3])  # None: the default, Megatron's 2
def test_dynamic_scale_skips_overflowing_steps_then_trains(hysteresis):
    kw = dict(fp16=True, initial_loss_scale=2.0**24, train_iters=16)
    if hysteresis is not None:
        kw["hysteresis"] = hysteresis
    history = launch(tw.train_tracking_weights, 1, kw, timeout=300)[0]
    skipped = [h["skipped"] for h in history]
    assert skipped[0] and not skipped[-1]  # 2^24 overflows fp16; the scale comes down
    # No growth in 16 iterations (--loss-scale-window 1000), so nothing restores the
    # tolerance: the first hysteresis - 1 overflows keep the scale, each later one halves it.
    left = hysteresis or 2
    assert sum(skipped) >= left  # the overflows that keep the scale and at least one halving
    weights = [None] + [h["weights"] for h in history]
    for i, h in enumerate(history):
        nxt = history[i + 1]["loss_scale"] if i + 1 < len(history) else None
        if h["skipped"]:
            assert math.isnan(h["grad_norm"])
            if weights[i] is not None:
                assert h["weights"] == weights[i]  # the step was not taken
            left -= 1
            if nxt is not None:
                assert nxt == (h["loss_scale"] / 2 if left <= 0 else h["loss_scale"])
        elif nxt is not None:
            assert nxt == h["loss_scale"]  # grows only after --loss-scale-window good steps
    assert history[-1]["loss"] < history[0]["loss"]


def test_static_scale_follows_the_fp32_curve_on_every_rank():
    fp32 = launch(tw.train, 1, timeout=300)[0]
    for history in launch(
        tw.train_kw, 2, dict(fp16=True, loss_scale=1024.0, tensor_model_parallel_size=2),
        timeout=300,
    ):  # fmt: skip
        assert [h["skipped"] for h in history] == [False] * 3
        assert [h["loss_scale"] for h in history] == [1024.0] * 3
        for h, r in zip(history, fp32, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=2e-3)


def test_fp16_and_bf16_together_are_refused():
    with pytest.raises(ConfigError, match="--bf16 and --fp16 exclude each other"):
        tw.tiny(fp16=True, bf16=True).check(1)


@pytest.mark.parametrize("ckpt_format", ["megart", "torch"])
def test_a_resumed_run_keeps_the_hysteresis_tracker(tmp_path, ckpt_format):
    """Saved after the first of its overflows (--hysteresis 3: the next keeps the scale, the
    one after halves it), a run resumes on the uninterrupted run's loss scales and skipped
    steps, in megart's format and in Megatron's (its grad scaler's hysteresis_tracker; also
    read from a file as Megatron-LM writes it, without megart's own record). A fresh tracker
    would halve the scale one step late."""
    from megart.training.checkpoint import FILE, iteration_dir, read_file

    kw = dict(fp16=True, initial_loss_scale=2.0**24, hysteresis=3, ckpt_format=ckpt_format,
              train_iters=6)  # fmt: skip
    straight = launch(tw.train_kw, 1, kw, timeout=300)[0]
    ckpt = tmp_path / "ckpt"
    # Stopped after 1 of the 6 iterations (the schedule is the 6-iteration run's, as Megatron's
    # scheduler state is checked against the flags on --load).
    launch(tw.train_kw, 1, dict(kw, save=str(ckpt), exit_interval=1), timeout=300)
    file = iteration_dir(ckpt, 1) / "mp_rank_00" / FILE
    assert read_file(file)["loss_scaler"] == {
        "scale": 2.0**24, "good_steps": 0, "hysteresis_tracker": 2
    }  # fmt: skip
    dirs = [ckpt]
    if ckpt_format == "torch":
        raw = torch.load(file, weights_only=False)
        scaler = raw["optimizer"]["grad_scaler"]
        assert (float(scaler["scale"]), scaler["growth_tracker"]) == (2.0**24, 0)
        assert scaler["hysteresis_tracker"] == 2 and raw["args"].hysteresis == 3
        theirs = tmp_path / "as-megatron-writes-it"
        shutil.copytree(ckpt, theirs)
        del raw["megart"]  # what megart keeps besides: read from Megatron's fields instead
        rank = iteration_dir(theirs, 1) / "mp_rank_00"
        torch.save(raw, rank / FILE)
        for sums in rank.glob("*.sha256"):  # megart's, which Megatron-LM does not write
            sums.unlink()
        dirs.append(theirs)
    want = [(h["loss_scale"], h["skipped"]) for h in straight[1:]]
    assert [s for _, s in want[:2]] == [True, True]  # overflows the tracker decides about
    for d in dirs:
        resumed = launch(tw.train_kw, 1, dict(kw, load=str(d)), timeout=300)[0]
        assert [h["iteration"] for h in resumed] == [2, 3, 4, 5, 6]
        assert [(h["loss_scale"], h["skipped"]) for h in resumed] == want, d


def test_a_megatron_file_of_a_static_loss_scale_resumes(tmp_path):
    """Megatron-LM's --loss-scale runs save their ConstantGradScaler's state, an empty dict,
    and so does megart's torch-format file of such a run; that file as Megatron-LM writes it
    (without megart's own record and checksums) resumes a static-scale run on its curve."""
    from megart.training.checkpoint import FILE, iteration_dir

    kw = dict(fp16=True, loss_scale=1024.0, ckpt_format="torch", train_iters=4)
    straight = launch(tw.train_kw, 1, kw, timeout=300)[0]
    ckpt = tmp_path / "ckpt"
    launch(tw.train_kw, 1, dict(kw, save=str(ckpt), exit_interval=2), timeout=300)
    rank = iteration_dir(ckpt, 2) / "mp_rank_00"
    raw = torch.load(rank / FILE, weights_only=False)
    assert raw["optimizer"]["grad_scaler"] == {}  # not the dynamic scaler's fields
    del raw["megart"]
    torch.save(raw, rank / FILE)
    for sums in rank.glob("*.sha256"):
        sums.unlink()
    resumed = launch(tw.train_kw, 1, dict(kw, load=str(ckpt)), timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [3, 4]
    assert [h["loss_scale"] for h in resumed] == [1024.0, 1024.0]
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in straight[2:]],
                                                         **SAME_RUN)  # fmt: skip
