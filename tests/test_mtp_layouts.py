"""Multi-token prediction (--mtp-num-layers, models.mtp) in megart train: every layout follows
the one-process curve, the main loss and each depth's ("mtp_k loss"), for the tied embedding
and an untied output layer: tensor parallelism with sequence parallelism (the depths' eh_proj
gathered and split again, their logits gathered rank-major), pipeline parallelism (the depths
on the last stage, reading the tokens from the labels, its embedding copy summed with the
first stage's, untied too), data parallelism with the distributed optimizer, recomputation,
and the zero-bubble and interleaved schedules; megart's checkpoints save the depths and resume
them in another layout on the curve."""

import pytest

import train_workers as tw
from megart.launcher import launch

MTP = dict(position_embedding_type="rope", mtp_num_layers=2, train_iters=4)
UNTIED = dict(MTP, untie_embeddings_and_output_weights=True, normalization="RMSNorm",
              swiglu=True, disable_bias_linear=True)  # fmt: skip
NAMES = ("loss", "mtp_1 loss", "mtp_2 loss")


def _curve(history: list[dict]) -> list[float]:
    return [h[name] for h in history for name in NAMES]


@pytest.fixture(scope="module")
def one_process():
    return {
        name: launch(tw.train_kw, 1, kw, timeout=300, env=tw.ONE_THREAD)[0]
        for name, kw in (("tied", MTP), ("untied", UNTIED))
    }


def test_the_depths_log_their_losses_and_train(one_process):
    history = one_process["tied"]
    assert all(3 < h["mtp_1 loss"] < 8 and 3 < h["mtp_2 loss"] < 8 for h in history)
    assert history[-1]["mtp_1 loss"] < history[0]["mtp_1 loss"]


LAYOUTS = {
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "tp2-no-sp": (2, dict(tensor_model_parallel_size=2)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "dp2-distopt": (2, dict(use_distributed_optimizer=True)),
    "pp2-zb-v": (2, dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v")),
    "pp2-interleaved": (
        2,
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),  # fmt: skip
    "tp2-sp-pp2": (
        4,
        dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2),
    ),  # fmt: skip
    "recompute-full": (1, dict(recompute_granularity="full", recompute_method="uniform")),
}


@pytest.mark.parametrize("model", ["tied", "untied"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_follows_the_one_process_curve(one_process, model, layout):
    if model == "untied" and layout in ("tp2-no-sp", "pp2-interleaved", "recompute-full"):
        pytest.skip("the tied model covers these; the untied one its own embedding copy")
    nproc, kw = LAYOUTS[layout]
    base = MTP if model == "tied" else UNTIED
    want = _curve(one_process[model])
    for rank in launch(tw.train_kw, nproc, {**base, **kw}, timeout=300):
        assert _curve(rank) == pytest.approx(want, rel=5e-6)


def test_a_pp2_tp2_checkpoint_resumes_on_one_process_on_the_curve(tmp_path, one_process):
    kw = dict(UNTIED, save=str(tmp_path), exit_interval=2, tensor_model_parallel_size=2,
              sequence_parallel=True, pipeline_model_parallel_size=2)  # fmt: skip
    launch(tw.train_kw, 4, kw, timeout=300)
    resumed = launch(tw.train_kw, 1, dict(UNTIED, load=str(tmp_path)), timeout=300)[0]
    assert [h["iteration"] for h in resumed] == [3, 4]
    assert _curve(resumed) == pytest.approx(_curve(one_process["untied"][2:]), rel=5e-6)
    # Without the depths the checkpoint's weights are another model's.
    with pytest.raises(Exception, match="mtp"):
        launch(tw.train_kw, 1, dict(UNTIED, load=str(tmp_path), mtp_num_layers=None), timeout=300)
