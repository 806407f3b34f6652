"""megart train with attention sinks (--softmax-type learnable, megart.models.sinks): the parallel
layouts follow the one-process loss curve (tensor parallelism with sequence parallelism, a
pipeline, context parallelism over each exchange, data parallelism with the distributed
optimizer), the sinks are in the curve and learn, and megart's checkpoints hold them, resumed
and resharded across tensor parallelism."""

import pytest

import train_workers as tw
from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.launcher import launch

# Weights drawn wider and a larger step than the tiny run's, so that attention, and with it the
# sink, moves the loss: at init_method_std 0.02 the three softmax types' curves agree to 1e-6.
TRAIN = dict(softmax_type="learnable", position_embedding_type="rope", train_iters=4,
             init_method_std=0.2, lr=1e-2)  # fmt: skip


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, TRAIN, timeout=300)[0]


# name: (processes, flags)
LAYOUTS = {
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "cp2-p2p": (2, dict(context_parallel_size=2)),
    "cp2-all_gather": (2, dict(context_parallel_size=2, cp_comm_type="all_gather")),
    "cp2-a2a": (2, dict(context_parallel_size=2, cp_comm_type="a2a")),
    "dp2-distopt": (2, dict(use_distributed_optimizer=True)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layouts_follow_the_one_process_curve(one_process, name):
    processes, kw = LAYOUTS[name]
    want = [h["loss"] for h in one_process]
    for rank in launch(tw.train_kw, processes, {**TRAIN, **kw}, timeout=300):
        assert [h["loss"] for h in rank] == pytest.approx(want, **tw.SAME_RUN)


def test_the_sinks_are_in_the_curve_and_learn(one_process):
    want = [h["loss"] for h in one_process]
    for kind in ("vanilla", "off-by-one"):
        other = launch(tw.train_kw, 1, dict(TRAIN, softmax_type=kind), timeout=300)[0]
        assert [h["loss"] for h in other] != pytest.approx(want, rel=1e-3)
    before = launch(tw.initial_weights, 1, TRAIN, timeout=300)[0]
    after = launch(tw.weights_after_training, 1, TRAIN, timeout=300)[0]
    name = "chunk.blocks.0.attn.softmax_offset"
    assert name in before and (after[name] - before[name]).abs().max() > 1e-4


@pytest.mark.parametrize("saved,resumed", [(2, 1), (1, 2)])
def test_megart_checkpoints_resume_and_reshard_across_tp(tmp_path, one_process, saved, resumed):
    """The resumed ranks hold exactly the saved sinks (and every weight and Adam moment),
    resharded over the heads, and train on the one-process curve."""
    save, run = (dict(TRAIN, tensor_model_parallel_size=t) for t in (saved, resumed))
    trained, again = tw.saved_and_resumed(saved, save, resumed, run, tmp_path)
    loaded = tw.assert_holds(trained, again)
    assert any("softmax_offset" in n for n in tw.merged_by_place(loaded, "weights"))
    tw.assert_resumed_on_curve(one_process, again, **tw.SAME_RUN)


def test_a_checkpoint_of_another_softmax_is_refused_by_name(tmp_path):
    launch(tw.train_kw, 1, dict(TRAIN, save=str(tmp_path), train_iters=1), timeout=300)
    with pytest.raises(Exception, match="--softmax-type learnable .now --softmax-type off-by-one"):
        again = dict(TRAIN, load=str(tmp_path), softmax_type="off-by-one")
        launch(tw.train_kw, 1, again, timeout=300)


def test_the_flag_takes_megatrons_choices():
    p = FlagParser(prog="megart train")
    add_arguments(p)
    for kind in ("vanilla", "off-by-one", "learnable"):
        assert config_from_args(p.parse_args(["--softmax-type", kind])).softmax_type == kind
    assert "--softmax-type" in p.format_help()


def test_checkpoint_formats_without_sinks_refuse_them_by_name(tmp_path):
    """Hugging Face's formats (none of megart's has a sink): refused on export, never dropped;
    Megatron-LM's take them (tests/test_megatron_sinks_ckpt.py)."""
    from megart.errors import ConfigError
    from megart.models import GPT

    says = "attention sinks .--softmax-type learnable.: megart does not write or read them in"
    for fmt in ("torch", "torch_dist"):
        tw.tiny(**TRAIN, ckpt_format=fmt).check(1)
    model = GPT(tw.tiny(**TRAIN).gpt_config())
    with pytest.raises(ConfigError, match=says + " Hugging Face's formats"):
        model.save_hf(str(tmp_path / "hf"))
