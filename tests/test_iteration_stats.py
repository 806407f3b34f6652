"""--log-params-norm and --log-num-zeros-in-grad (megart.training.iteration_stats), as
Megatron-LM computes them: the weights' L2 norm after the step and the gradient's zero elements,
each element of the model counted once over the ranks, from the fp32 tensors the step reads.

References: the norm of every weight of the one-process model, computed here in float64, and
the zeros known in advance. With a vocabulary of 200 padded to 256 rows, the padded rows' 56 x h
gradients are zero and outside the loss, while every other gradient element (the tied
embedding's real rows through the output layer included) is not: on every layout the count is
exactly 56 x h. The models have no linear biases: the key bias's gradient is zero in exact
arithmetic (softmax ignores a constant added to a row's scores) and rounds to exactly zero in
one element or two of some iterations (seen: 1792, 1794, 1793 with biases), which Megatron
counts too but no layout can be compared on. In bf16 a weight gradient's element rounds to zero
now and then too (seen: one in three iterations): there the count is checked against the
gradients themselves in one process, and bounded on the other layouts."""

import pytest
import torch

import megatron_workers as mw
import train_workers as tw
from megart.launcher import launch

PADDED = dict(vocab_size=200, mock_data=True, disable_bias_linear=True)  # 256 rows, t 1 or 2
ZEROS = (256 - 200) * 32  # padded rows x hidden size
FLAGS = dict(PADDED, log_params_norm=True, log_num_zeros_in_grad=True, train_iters=3)


def _norm_against_the_weights(kw: dict) -> tuple[list[dict], float, float, int]:
    """Trains one process; returns its figures, the float64 norm of the weights the optimizer
    steps (the fp32 main weights under --half-weights) and of the model's own parameters, and
    the zeros of the gradients the last step read (kept until the next iteration zeroes them;
    clipping scales them, which leaves zeros zero)."""
    from megart.tensor_parallel import grad_of
    from megart.training.data import builtin_corpus
    from megart.training.main_weights import MainWeights
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    history = trainer.train(quiet=True)
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    half = isinstance(trainer.optimizer, MainWeights)
    stepped = trainer.optimizer.mains if half else params
    grads = [t.grad if half else grad_of(t) for t in stepped]
    flat = torch.cat([t.detach().double().flatten() for t in stepped])
    own = torch.cat([t.detach().double().flatten() for t in params])
    zeros = sum(int((g == 0).sum()) for g in grads)
    return history, flat.norm().item(), own.norm().item(), zeros


@pytest.mark.parametrize(
    "precision", [{}, dict(bf16=True, half_weights=True)], ids=["fp32", "bf16-half"]
)
def test_one_process_figures_are_the_weights_norm_and_the_padded_rows(precision):
    history, norm, own, zeros = launch(
        _norm_against_the_weights, 1, dict(FLAGS, **precision), timeout=300
    )[0]
    assert history[-1]["params_norm"] == pytest.approx(norm, rel=1e-12)
    if precision:  # the main weights', not their 16-bit rounding's (which differs by ~1e-5)
        assert abs(own - norm) > 1e-9 * norm
    assert history[-1]["num_zeros_in_grad"] == zeros >= ZEROS
    if not precision:
        assert [h["num_zeros_in_grad"] for h in history] == [ZEROS] * 3


LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),  # the tied embedding held twice, counted once
    "dp2-distopt": dict(use_distributed_optimizer=True),
    "dp2-distopt-half": dict(use_distributed_optimizer=True, bf16=True, half_weights=True),
    "tp2-half": dict(tensor_model_parallel_size=2, bf16=True, half_weights=True),
}


@pytest.fixture(scope="module")
def one_process():
    return {
        half: launch(tw.train_kw, 1, dict(FLAGS, **precision), timeout=300)[0]
        for half, precision in ((False, {}), (True, dict(bf16=True, half_weights=True)))
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_counts_the_model_once(one_process, layout):
    kw = dict(FLAGS, **LAYOUTS[layout])
    want = one_process[bool(kw.get("half_weights"))]
    for rank in launch(tw.train_kw, 2, kw, timeout=300):
        zeros = [h["num_zeros_in_grad"] for h in rank]
        if kw.get("half_weights"):  # the padded rows, and a few rounded to zero at most
            assert all(ZEROS <= z <= ZEROS + 8 for z in zeros), zeros
        else:
            assert zeros == [ZEROS] * 3
        assert [h["params_norm"] for h in rank] == pytest.approx(
            [h["params_norm"] for h in want], rel=1e-5
        )


def test_the_figures_reach_tensorboard_when_asked_for(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    kw = dict(FLAGS, tensorboard_dir=str(tmp_path), log_world_size_to_tensorboard=True)
    history = launch(tw.train_kw, 2, dict(kw, tensor_model_parallel_size=2), timeout=300)[0]
    board = event_accumulator.EventAccumulator(str(tmp_path))
    board.Reload()
    assert [e.value for e in board.Scalars("params-norm")] == pytest.approx(
        [h["params_norm"] for h in history], rel=1e-6
    )
    assert [e.value for e in board.Scalars("num-zeros")] == [ZEROS] * 3
    assert [e.value for e in board.Scalars("world-size")] == [2] * 3
    plain = launch(tw.train_kw, 1, dict(PADDED, train_iters=1), timeout=300)[0][0]
    assert "params_norm" not in plain and "num_zeros_in_grad" not in plain  # asked for only


def test_megatron_scripts_flags_print_megatrons_figures():
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-3", "--vocab-size", "200", "--mock-data",
            "--disable-bias-linear", "--log-interval", "1", "--log-params-norm",
            "--log-num-zeros-in-grad"]  # fmt: skip
    status, out = launch(mw.run_cli, 1, argv, timeout=300)[0]
    assert status == 0, out
    assert out.count("| num zeros 1792 | params norm ") == 2, out
