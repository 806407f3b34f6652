"""`megart train` with Megatron's uneven pipeline stages (--decoder-first-pipeline-num-layers,
--decoder-last-pipeline-num-layers): each rank builds the layers Megatron-Core would give it,
the loss curve is the one-process run's, and a megart checkpoint saved under one split resumes
under an even layout and under another split (resharded) on the uninterrupted curve; what
cannot run is refused before any work, naming the flags."""

import re

import pytest

import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch

# 6 layers, so that pp4 can hold 1 | 2 | 2 | 1 and pp2 1 | 5. As in test_checkpoint_reshard: a
# vocabulary whose padding changes with t, the rate decaying over 5 iterations in every run.
BASE = dict(num_layers=6, vocab_size=300, lr_decay_iters=5)
REL = 5e-6  # see test_checkpoint_reshard: a misplaced layer or lost moments move it far more
UNEVEN4 = dict(
    pipeline_model_parallel_size=4,
    decoder_first_pipeline_num_layers=1,
    decoder_last_pipeline_num_layers=1,
)


def _run(nproc, kw):
    return launch(tw.train_holding, nproc, {**BASE, **kw}, timeout=300)


def _layers(rank):
    """The layers a rank held, read from its parameters' names."""
    names = rank["trained"]["weights"]
    return sorted({int(m[1]) for n in names if (m := re.match(r"chunk\.blocks\.(\d+)\.", n))})


def _losses(rank):
    return [h["loss"] for h in rank["history"]]


@pytest.fixture(scope="module")
def straight():
    return _losses(_run(1, dict(train_iters=5))[0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("uneven") / "ckpt"
    return ckpt, _run(4, dict(train_iters=2, save=str(ckpt), **UNEVEN4))


def test_pp4_uneven_places_megatron_cores_layers_on_the_one_process_curve(saved, straight):
    _, per_rank = saved
    assert [_layers(r) for r in per_rank] == [[0], [1, 2], [3, 4], [5]]
    assert _losses(per_rank[0]) == pytest.approx(straight[:2], rel=REL, abs=0)


def test_uneven_checkpoint_reshards_to_even_and_to_another_split(saved, straight, tmp_path, capfd):
    """pp4 1|2|2|1 -> pp2 even (3|3) -> pp2 1|5 under zb-h1, each resumed on the curve."""
    ckpt, per_rank = saved
    held = tw.merged_by_place([r["trained"] for r in per_rank], "weights")
    even = tmp_path / "even"
    capfd.readouterr()
    ranks = _run(2, dict(train_iters=4, load=str(ckpt), save=str(even),
                         pipeline_model_parallel_size=2))  # fmt: skip
    assert (
        "saved under tp 1 x pp 4, layers per stage 1 | 2 | 2 | 1, resharded to tp 1 x pp 2, "
        "layers per stage 3 | 3;" in capfd.readouterr().out
    )
    assert [_layers(r) for r in ranks] == [[0, 1, 2], [3, 4, 5]]
    loaded = tw.merged_by_place([r["loaded"] for r in ranks], "weights")
    assert loaded.keys() == held.keys()
    assert all(loaded[k].equal(v) for k, v in held.items())
    assert _losses(ranks[0]) == pytest.approx(straight[2:4], rel=REL, abs=0)

    back = dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)
    ranks = _run(2, dict(train_iters=5, load=str(even), pipeline_schedule="zb-h1", **back))
    assert [_layers(r) for r in ranks] == [[0], [1, 2, 3, 4, 5]]
    assert _losses(ranks[0]) == pytest.approx(straight[4:5], rel=REL, abs=0)


def test_interleaved_uneven_stages_follow_the_one_process_curve():
    """pp4, 10 layers, first 2 and last 4, two chunks per rank (--num-virtual-stages-per-
    pipeline-rank, Megatron-LM's spelling with uneven stages): chunks of 1, 1, 1, 2 layers."""
    kw = dict(num_layers=10, train_iters=3)
    want = _losses(_run(1, kw)[0])
    layout = dict(UNEVEN4, decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=4)
    ranks = _run(4, dict(kw, num_virtual_stages_per_pipeline_rank=2, **layout))
    assert [_layers(r) for r in ranks] == [[0, 5], [1, 6], [2, 7], [3, 4, 8, 9]]
    assert _losses(ranks[0]) == pytest.approx(want, rel=REL, abs=0)


def test_the_flags_parse_with_megatrons_names():
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        ["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "2"]
    )
    config = config_from_args(args)
    assert (config.decoder_first_pipeline_num_layers, config.decoder_last_pipeline_num_layers) == (
        3,
        2,
    )
    assert "layers on the first pipeline stage" in " ".join(p.format_help().split())


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(num_layers_per_virtual_pipeline_stage=1), "--num-virtual-stages-per-pipeline-rank"),
        (dict(num_virtual_stages_per_pipeline_rank=2), "divisible by the 2 model chunks"),
        (dict(pipeline_schedule="zb-v", global_batch_size=16), "zb-v"),
        (dict(decoder_last_pipeline_num_layers=2), "leave 3 of --num-layers 6"),
        (dict(decoder_first_pipeline_num_layers=0), "must be at least 1"),
        (dict(pipeline_model_parallel_size=1), "at least 2"),
    ],
)
def test_refused_before_any_work_naming_the_flags(kw, says):
    config = tw.tiny(**{**BASE, **UNEVEN4, **kw})
    with pytest.raises(ConfigError, match="--decoder-") as e:
        config.check(config.pp)
    assert says in str(e.value)
