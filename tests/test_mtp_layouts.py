"""Multi-token prediction (--mtp-num-layers, models.mtp) in megart train: every layout follows
the one-process curve, the main loss and each depth's ("mtp_k loss"), for the tied embedding
and an untied output layer: tensor parallelism with sequence parallelism (the depths' eh_proj
gathered and split again, their logits gathered rank-major), pipeline parallelism (the depths
on the last stage, reading the tokens from the labels, its embedding copy summed with the
first stage's, untied too), data parallelism with the distributed optimizer, recomputation,
and the zero-bubble and interleaved schedules; megart's checkpoints save the depths and resume
them in another layout on the curve."""

import pytest

import mtp_workers as mw
import train_workers as tw
from megart.launcher import launch

MTP = dict(position_embedding_type="rope", mtp_num_layers=2, train_iters=4)
UNTIED = dict(MTP, untie_embeddings_and_output_weights=True, normalization="RMSNorm",
              swiglu=True, disable_bias_linear=True)  # fmt: skip
NAMES = ("loss", "mtp_1 loss", "mtp_2 loss")


def _curve(history: list[dict]) -> list[float]:
    return mw.curve(history, NAMES)


@pytest.fixture(scope="module")
def one_process():
    return mw.one_process_histories({"tied": MTP, "untied": UNTIED})


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
    "recompute-selective-mlp": (
        1,
        dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
    ),  # fmt: skip
    "pp2-zb-h1": (2, dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1")),
    "dp2-pp2-distopt": (4, dict(pipeline_model_parallel_size=2, use_distributed_optimizer=True)),
}


@pytest.mark.parametrize("model", ["tied", "untied"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_follows_the_one_process_curve(one_process, model, layout):
    tied_only = ("tp2-no-sp", "pp2-interleaved", "recompute-full", "recompute-selective-mlp",
                 "pp2-zb-h1")  # fmt: skip
    if model == "untied" and layout in tied_only:
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


DOCUMENTS = dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True,
                 mtp_num_layers=2, train_iters=3)  # fmt: skip


@pytest.fixture(scope="module")
def documents_one_process():
    import mtp_workers as mw

    return {
        "rope": launch(mw.document_curve, 1, DOCUMENTS, timeout=300)[0],
        # Learned positions: each depth adds the rows of its shifted positions.
        "learned": launch(mw.document_curve, 1, dict(DOCUMENTS, reset_attention_mask=False,
                                                     position_embedding_type="learned_absolute"),
                          timeout=300)[0],
    }  # fmt: skip


@pytest.mark.parametrize(
    "positions, kw",
    [
        ("rope", dict(pipeline_model_parallel_size=2)),
        ("rope", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        ("learned", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ],
    ids=["rope-pp2", "rope-tp2-sp", "learned-tp2-sp"],
)
def test_document_flags_follow_the_one_process_curve(documents_one_process, positions, kw):
    """--eod-mask-loss (the depths' masks shifted with their labels), --reset-position-ids
    and --reset-attention-mask: losses, gradient norms and depth losses."""
    import mtp_workers as mw

    want = documents_one_process[positions]
    run = dict(DOCUMENTS, **kw)
    if positions == "learned":
        run.update(reset_attention_mask=False, position_embedding_type="learned_absolute")
    assert len(want) == 3 * 4
    for got in launch(mw.document_curve, 2, run, timeout=300):
        assert got == pytest.approx(want, rel=5e-6)


def test_the_depth_losses_go_to_the_iteration_line_and_tensorboard(tmp_path):
    """Under Megatron-LM's names, "mtp_1 loss" and so on, beside the main loss."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    from megart.training.reporting import progress_line

    kw = dict(MTP, train_iters=2, tensorboard_dir=str(tmp_path))
    history = launch(tw.train_kw, 1, kw, timeout=300)[0]
    line = progress_line(history[-1], 2, cpu=True)
    assert f"| mtp_1 loss {history[-1]['mtp_1 loss']:.4E} | mtp_2 loss " in line
    board = event_accumulator.EventAccumulator(str(tmp_path))
    board.Reload()
    for name in ("mtp_1 loss", "mtp_2 loss"):
        logged = [(e.step, e.value) for e in board.Scalars(name)]
        assert logged == [(h["iteration"], pytest.approx(h[name])) for h in history]
