"""Resharding on load: a checkpoint saved under tp2 x pp2 resumes under tp1, pp2 interleaved,
tp2, dp2 and tp2 x dp2 with the distributed optimizer, holding right after load exactly the
weights and Adam moments the saving ranks held, and continuing the loss curve of an
uninterrupted run; a data-parallel size change alone loads as it is; --finetune,
--no-load-optim and --no-load-rng leave out what they say; another model is refused naming the
flags; splitting is the inverse of the exporter's merging."""

import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPTChunk, GPTConfig
from megart.models.vocab import fit_vocab
from megart.training import checkpoint, reshard
from megart.training.shards import merge_shards, split_shard

# vocab 300 is padded to 384 under tp 1 and to 512 under tp 2: resharding changes the padding.
# Dropout is off (the default), so the curve does not depend on the random streams, which a
# layout change cannot carry over. The learning rate decays over 5 iterations in every run
# (by default over --train-iters, which differ).
BASE = dict(vocab_size=300, lr_decay_iters=5)
SAVED = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
TARGETS = {
    "tp1": (1, {}),
    "pp2-interleaved": (
        2,
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "dp2": (2, {}),
    # Sliced again on load: each data-parallel rank keeps 1/dp of the resharded moments.
    "tp2-dp2-distributed-optimizer": (
        4,
        dict(tensor_model_parallel_size=2, use_distributed_optimizer=True),
    ),
}
FILE = "model_optim_rng.pt"
# The same seed gives the same curve under every layout up to the order of floating-point sums
# (observed: 4e-8 relative), and a resharded resume restarts from the exact weights and moments
# (observed: within 2e-8 of the uninterrupted curve). CI's CPUs have differed by 5e-7 across
# processes (test_evaluation). Fresh moments move iteration 4 by 3e-5 and a misplaced shard
# moves iteration 3 by 2e-4, so 5e-6 tells a right resume from a wrong one (1e-4 would not see
# lost moments).
REL = 5e-6


def _run(nproc, kw):
    return launch(tw.train_holding, nproc, {**BASE, **kw}, timeout=300)


def _same_rng(a, b):
    (cpu_a, tracker_a), (cpu_b, tracker_b) = a, b
    return (
        torch.equal(cpu_a, cpu_b)
        and tracker_a.keys() == tracker_b.keys()
        and all(torch.equal(tracker_a[n][0], tracker_b[n][0]) for n in tracker_a)
    )


def _plant_rng(directory):
    """Replaces every file's random streams with seed 999's, so that a test can tell whether
    they were loaded (with dropout off, training may not move them from their seeded start)."""
    seeded = torch.Generator().manual_seed(999).get_state()

    def plant(state):
        state["rng"] = {
            "torch": seeded,
            "cuda": None,
            "tracker": {n: (seeded, None) for n in state["rng"]["tracker"]},
        }

    for path in directory.glob(f"iter_*/mp_rank_*/{FILE}"):
        tw.rewrite_checkpoint_file(path, plant)
    return seeded


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tp2 x pp2 checkpoint after 2 iterations, with planted random streams, and what the
    saving ranks held then (merged over ranks)."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    per_rank = _run(4, dict(train_iters=2, save=str(ckpt), **SAVED))
    planted = _plant_rng(ckpt)
    trained = [r["trained"] for r in per_rank]
    held = {k: tw.merged_by_place(trained, k) for k in ("weights", "exp_avg", "exp_avg_sq")}
    return ckpt, held, planted


@pytest.fixture(scope="module")
def straight():
    """An uninterrupted one-process run of the same seed: its curve, its fresh random streams."""
    rank = _run(1, dict(train_iters=5))[0]
    return [h["loss"] for h in rank["history"]], rank["loaded"]["rng"]


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory):
    """Resumes the saved checkpoint under a layout of TARGETS once per module (to iteration 4,
    saving there): (per-rank results, its own checkpoint directory, the printed output)."""
    done = {}

    def get(name, capfd):
        if name not in done:
            nproc, layout = TARGETS[name]
            out = tmp_path_factory.mktemp(name) / "ckpt"
            capfd.readouterr()
            kw = dict(train_iters=4, load=str(saved[0]), save=str(out), **layout)
            done[name] = _run(nproc, kw), out, capfd.readouterr().out
        return done[name]

    return get


@pytest.mark.parametrize("name", list(TARGETS))
def test_resharded_resume_holds_the_saved_state_and_continues_the_curve(
    name, saved, straight, resumed, capfd
):
    per_rank, _, printed = resumed(name, capfd)
    _, held, planted = saved
    loaded = [r["loaded"] for r in per_rank]
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        got = tw.merged_by_place(loaded, key)
        assert got.keys() == held[key].keys()
        for place, value in held[key].items():
            assert torch.equal(got[place], value), (key, place)
    for state in loaded:
        assert state["steps"] == {2.0}
        assert state["padding"] == 0.0
    # Random streams are not resharded: rank 0 (tensor and pipeline rank 0 in every layout)
    # has the fresh streams of the seed, as the uninterrupted run had at its start.
    assert _same_rng(loaded[0]["rng"], straight[1])
    assert not torch.equal(loaded[0]["rng"][0], planted)
    assert printed.count("cannot be resharded") == 1  # one line, from rank 0
    history = per_rank[0]["history"]
    assert [h["iteration"] for h in history] == [3, 4]
    assert [h["loss"] for h in history] == pytest.approx(straight[0][2:4], rel=REL, abs=0)


def test_a_data_parallel_change_alone_loads_as_saved(resumed, straight, tmp_path, capfd):
    """dp2 -> dp1 (tensor and pipeline sizes unchanged): no resharding, random streams too."""
    _, ckpt, _ = resumed("dp2", capfd)
    copy = shutil.copytree(ckpt, tmp_path / "ckpt")
    planted = _plant_rng(copy)
    capfd.readouterr()
    rank = _run(1, dict(train_iters=5, load=str(copy)))[0]
    assert "resharded" not in capfd.readouterr().out
    assert torch.equal(rank["loaded"]["rng"][0], planted)
    assert rank["loaded"]["steps"] == {4.0}
    assert [h["iteration"] for h in rank["history"]] == [5]
    assert rank["history"][0]["loss"] == pytest.approx(straight[0][4], rel=REL, abs=0)


def test_no_load_rng_keeps_the_seeded_streams(resumed, straight, tmp_path, capfd):
    _, ckpt, _ = resumed("dp2", capfd)
    copy = shutil.copytree(ckpt, tmp_path / "ckpt")
    _plant_rng(copy)
    rank = _run(1, dict(train_iters=5, load=str(copy), no_load_rng=True))[0]
    assert _same_rng(rank["loaded"]["rng"], straight[1])
    assert rank["loaded"]["steps"] == {4.0}  # the rest is loaded


@pytest.mark.parametrize(
    "flag, iterations", [("finetune", [1, 2, 3, 4]), ("no_load_optim", [3, 4])]
)
def test_finetune_and_no_load_optim_load_the_weights_only(flag, iterations, saved, straight):
    ckpt, held, _ = saved
    rank = _run(1, dict(train_iters=4, load=str(ckpt), **{flag: True}))[0]
    weights = rank["loaded"]["weights"]
    assert all(torch.equal(weights[place], value) for place, value in held["weights"].items())
    assert rank["loaded"]["optimizer_states"] == 0  # fresh moments
    losses = [h["loss"] for h in rank["history"]]
    assert [h["iteration"] for h in rank["history"]] == iterations
    if flag == "no_load_optim":
        # Iteration 3 runs on the loaded weights; its step, with fresh moments, leaves the
        # curve by more than REL: the tolerance is tight enough to see lost moments.
        assert losses[0] == pytest.approx(straight[0][2], rel=REL, abs=0)
        assert losses[1] != pytest.approx(straight[0][3], rel=REL, abs=0)


def test_checkpoints_without_optimizer_names_reshard_by_the_trainers_order(saved, tmp_path):
    ckpt, held, _ = saved
    old = shutil.copytree(ckpt, tmp_path / "old")
    for path in old.glob(f"iter_*/mp_rank_*/{FILE}"):
        tw.rewrite_checkpoint_file(path, lambda state: state.pop("optimizer_params"))
    loaded = _run(1, dict(train_iters=3, load=str(old)))[0]["loaded"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(loaded[key][p], value) for p, value in held[key].items()), key


def test_optimizer_states_that_do_not_fit_the_model_are_refused(saved):
    path = saved[0] / "iter_0000002" / "mp_rank_00_000" / FILE
    state = checkpoint.read_file(path)
    state["optimizer_params"] = list(reversed(state["optimizer_params"]))
    with pytest.raises(ConfigError, match="cannot be matched.*--no-load-optim"):
        reshard._states(path.parent, (0, 0), state)


def test_another_model_is_refused_naming_the_flags(saved):
    """Under another layout too: the model's sizes are compared before any resharding."""
    config = tw.tiny(**BASE, hidden_size=64, load=str(saved[0]))
    model = GPTConfig(
        vocab_size=300, seq_length=16, hidden_size=64, num_layers=4, num_attention_heads=4
    )
    chunks = [GPTChunk(model, range(4), True, True)]
    grid = SimpleNamespace(tp_rank=0, pp_rank=0)
    with pytest.raises(ConfigError, match=r"--hidden-size 32 \(now 64\).*cannot be resharded"):
        checkpoint.load(saved[0], config, grid, chunks, None, None)


def test_load_flags_parse_and_need_load():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--load", "d", "--finetune", "--no-load-optim", "--no-load-rng"])
    config = config_from_args(args)
    assert (config.finetune, config.no_load_optim, config.no_load_rng) == (True, True, True)
    with pytest.raises(ConfigError, match="--no-load-optim and --finetune .*give --load DIR"):
        tw.tiny(no_load_optim=True, finetune=True).check(1)


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 4),
    rows=st.integers(1, 3),
    cols=st.integers(1, 3),
    dim=st.sampled_from([None, 0, 1]),
)
def test_split_takes_the_layers_shards_and_merge_inverts_it(t, rows, cols, dim):
    whole = torch.randn(t * rows, t * cols, generator=torch.Generator().manual_seed(t * cols))
    shards = [split_shard(whole, dim, t, r) for r in range(t)]
    # As the tensor-parallel layers take their shards: rank r holds chunk r along the dim.
    assert all(
        torch.equal(s, whole if dim is None else whole.chunk(t, dim)[r])
        for r, s in enumerate(shards)
    )
    assert torch.equal(merge_shards(shards, dim), whole)
    assert all(
        torch.equal(split_shard(merge_shards(shards, dim), dim, t, r), shards[r]) for r in range(t)
    )


@settings(max_examples=20, deadline=None)
@given(vocab=st.integers(1, 700), saved_tp=st.integers(1, 4), tp=st.integers(1, 4))
def test_vocab_padding_is_refitted_between_tensor_parallel_sizes(vocab, saved_tp, tp):
    cfg = GPTConfig(vocab_size=vocab, hidden_size=8, num_attention_heads=2)
    weights = torch.randn(vocab, 3, generator=torch.Generator().manual_seed(vocab))
    saved = fit_vocab(weights, cfg.padded_vocab_size(saved_tp))  # the zero rows padding adds
    shards = [split_shard(saved, 0, saved_tp, r) for r in range(saved_tp)]
    whole = fit_vocab(merge_shards(shards, 0), cfg.padded_vocab_size(tp))
    assert whole.shape[0] == cfg.padded_vocab_size(tp)
    assert torch.equal(whole[:vocab], weights) and not whole[vocab:].any()
