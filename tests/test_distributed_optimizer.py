"""--use-distributed-optimizer (ZeRO-1): each data-parallel rank steps 1/dp of the parameters.
Every layout still follows the single-process loss curve (clipping included); the moments are
split over the data-parallel ranks, each element held once; checkpoints are those of the plain
optimizer, so a run resumes with the flag switched either way; fp16 overflow still skips."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import train_workers as tw
from megart.launcher import launch
from megart.training.distributed_optimizer import pieces_of

ON = dict(use_distributed_optimizer=True)
# clip_grad 0.05 is below every iteration's norm here (about 0.5-1.5), so every step clips:
# the norm must be summed over the slices of every rank.
CLIPPED = dict(clip_grad=0.05)


@given(
    numels=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    parts=st.integers(1, 9),
)
def test_slices_cover_every_parameter_exactly_once(numels, parts):
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    padded = -(-sum(numels) // parts) * parts
    size = padded // parts
    covered = [[0] * n for n in numels]
    for rank in range(parts):
        for i, start, end in pieces_of(offsets, numels, (rank * size, (rank + 1) * size)):
            assert 0 <= start < end <= numels[i]
            assert rank * size <= offsets[i] + start and offsets[i] + end <= (rank + 1) * size
            for e in range(start, end):
                covered[i][e] += 1
    assert all(c == [1] * n for c, n in zip(covered, numels, strict=True))


LAYOUTS = {
    "dp2": (2, {}),
    "dp4": (4, {}),  # one microbatch per rank; small buckets split unevenly
    "tp2-dp2-sequence-parallel": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2-dp2-interleaved": (
        4,
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),
}


@pytest.fixture(scope="module")
def reference():
    return launch(tw.train_kw, 1, CLIPPED, timeout=300)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_follows_the_single_process_loss_curve(name, reference):
    nproc, layout = LAYOUTS[name]
    for history in launch(tw.train_kw, nproc, {**CLIPPED, **ON, **layout}, timeout=300):
        assert [h["iteration"] for h in history] == [1, 2, 3]
        for h, r in zip(history, reference, strict=True):
            assert r["grad_norm"] > CLIPPED["clip_grad"]
            assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)


def moments_held(kw):
    """(elements of Adam's moments this rank holds, parameters of the model) after training."""
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    trainer.train(quiet=True)
    state = trainer.optimizer.optimizer.state
    held = sum(s["exp_avg"].numel() for s in state.values())
    assert all(s["exp_avg_sq"].numel() == s["exp_avg"].numel() for s in state.values())
    return held, sum(p.numel() for c in trainer.chunks for p in c.parameters())


def test_each_rank_holds_its_share_of_the_moments_and_no_more():
    per_rank = launch(moments_held, 4, ON, timeout=300)
    total = per_rank[0][1]
    held = [h for h, _ in per_rank]
    assert sum(held) == total  # every element once
    # Each bucket pads to a multiple of 4 elements, so a rank's share is within a few elements
    # of a quarter (the plain optimizer holds all of them on every rank).
    assert max(held) - min(held) < 64
    assert max(held) < total / 4 + 64


def test_the_checkpoint_is_the_plain_optimizers(tmp_path):
    """Saved under dp2 with the flag: the same file contents as without it."""
    for flag, sub in ((ON, "on"), ({}, "off")):
        launch(tw.train_kw, 2, dict(train_iters=2, save=str(tmp_path / sub), **flag), timeout=300)
    files = [
        torch.load(tmp_path / s / "iter_0000002/mp_rank_00/model_optim_rng.pt")
        for s in ("on", "off")
    ]
    on, off = (f["optimizer"] for f in files)
    assert on["state"].keys() == off["state"].keys() and len(on["state"]) > 0
    for i, state in off["state"].items():
        assert float(on["state"][i]["step"]) == float(state["step"]) == 2.0
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(on["state"][i][key], state[key], rtol=1e-6, atol=0)
    assert [g["params"] for g in on["param_groups"]] == [g["params"] for g in off["param_groups"]]
    for name, value in files[1]["model"][0].items():
        torch.testing.assert_close(files[0]["model"][0][name], value, rtol=1e-6, atol=0)


@pytest.mark.parametrize("saved_with,resumed_with", [(ON, {}), ({}, ON)])
def test_a_run_resumes_with_the_flag_switched(tmp_path, saved_with, resumed_with):
    straight = launch(tw.train_kw, 2, dict(train_iters=4), timeout=300)[0]
    launch(tw.train_kw, 2, dict(train_iters=2, save=str(tmp_path), **saved_with), timeout=300)
    for resumed in launch(
        tw.train_kw, 2, dict(train_iters=4, load=str(tmp_path), **resumed_with), timeout=300
    ):
        assert [h["iteration"] for h in resumed] == [3, 4]
        for h, s in zip(resumed, straight[2:], strict=True):
            assert h["loss"] == pytest.approx(s["loss"], rel=1e-6)


def test_fp16_overflow_skips_the_step_on_every_rank():
    kw = dict(fp16=True, initial_loss_scale=2.0**24, train_iters=12, **ON)
    per_rank = launch(tw.train_tracking_weights, 2, kw, timeout=300)
    for history in per_rank:
        assert history[0]["skipped"] and not history[-1]["skipped"]
        for before, h in zip(history, history[1:], strict=False):
            if h["skipped"]:
                assert h["weights"] == before["weights"]  # the all-gather brought nothing new
        assert history[-1]["loss"] < history[0]["loss"]
    # Data-parallel ranks hold the same weights after every iteration.
    assert [h["weights"] for h in per_rank[0]] == [h["weights"] for h in per_rank[1]]
