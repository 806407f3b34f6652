"""megart train --ckpt-format torch_dist (and the legacy torch) under context parallelism:
the weights' layout does not depend on cp (rank 0 of the data x context-parallel ranks writes
them, Megatron-Core's replica 0), and the distributed optimizer's dp_reshardable state is
sharded over d x cp (its buckets padded for that group). A store saved under cp resumes
without it and the reverse, on the uninterrupted curve holding the saved state exactly;
Megatron-Core's own DistributedOptimizer, its parallel state at cp3, reads megart's cp3 store
and writes the same store, which megart resumes."""

import pytest

import train_workers as tw
from megart.launcher import launch
from megart.training.checkpoint import iteration_dir
from megart.training.megatron_dist import read_common
from megart.training.megatron_dist_distopt import read_object
from test_megatron_dist_distopt import GROUP0, _global_name, assert_same_store, model_config_of

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

# A layout change reorders floating-point sums (test_megatron_dist_save: REL).
REL = 5e-6
MOMENTS = ("exp_avg", "exp_avg_sq")
DIST = dict(ckpt_format="torch_dist")
DISTOPT = dict(use_distributed_optimizer=True)
SP = dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
# cp3 x d1 shards the optimizer over 3 ranks: its buckets pad to lcm(3, 128) = 384 elements,
# where d alone would give 128. 24 tokens: divisible by 2 x 3.
CP3 = dict(context_parallel_size=3, seq_length=24)
SCENARIOS = {  # name: (saving ranks, flags), (resuming ranks, flags)
    # Plain Adam: only the data x context-parallel rank 0 of each tensor rank writes.
    "tp2-cp2-sp-to-one": ((4, dict(DIST, **SP)), (1, {})),
    "cp3-distopt-to-one": ((3, dict(DIST, **DISTOPT, **CP3)), (1, dict(seq_length=24))),
    "dp2-distopt-to-cp2-dp2": ((2, dict(DIST, **DISTOPT)),
                               (4, dict(DISTOPT, context_parallel_size=2))),
    # Megatron-LM's legacy format: distrib_optim.pt gathered over d x cp by its rank 0
    # (Megatron-Core's side: tests/test_megatron_distrib_optim.py's llama-cp2).
    "cp2-distopt-legacy-to-one": ((2, dict(DISTOPT, ckpt_format="torch", context_parallel_size=2)),
                                  (1, DISTOPT)),
}  # fmt: skip


def _plain(flags: dict) -> dict:
    """The run without its checkpoint format or context parallelism: the one-process curve."""
    drop = ("ckpt_format", "context_parallel_size", "tensor_model_parallel_size",
            "sequence_parallel")  # fmt: skip
    return {k: v for k, v in flags.items() if k not in drop}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per scenario: the uninterrupted one-process curve, the store saved after 2 of 4
    iterations, what the saving ranks held then, and the run resumed from the store."""
    out = {}
    for name, ((n_save, save), (n_run, run)) in SCENARIOS.items():
        straight = tw.holding(1, dict(_plain(save), train_iters=4))[0]["history"]
        store = tmp_path_factory.mktemp(name) / "ckpt"
        out[name] = (straight, store, *tw.saved_and_resumed(n_save, save, n_run, run, store))
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_continues_the_curve_holding_exactly_what_was_saved(runs, name):
    straight, _, trained, resumed = runs[name]
    tw.assert_resumed_on_curve(straight, resumed, rel=REL, abs=0)
    assert all(rank["steps"] == {2.0} for rank in tw.assert_holds(trained, resumed))


def test_one_replica_writes_the_weights_every_rank_its_optimizer_shard(runs):
    """Plain Adam at tp2 x cp2: ranks 0 and 1 (cp rank 0) write, ranks 2 and 3 nothing; the
    distributed optimizer at cp3: every rank its shard."""
    for name, writers in (("tp2-cp2-sp-to-one", [0, 1]), ("cp3-distopt-to-one", [0, 1, 2])):
        root = iteration_dir(runs[name][1], 2)
        names = sorted(p.name for p in root.iterdir() if p.suffix == ".distcp")
        assert names == [f"__{r}_0.distcp" for r in writers], name
    args = read_common(iteration_dir(runs["cp3-distopt-to-one"][1], 2))["args"]
    assert (args.context_parallel_size, args.data_parallel_size) == (3, 1)


@pytest.fixture(scope="module")
def megatron(runs, tmp_path_factory):
    """Megatron-Core's ranks at cp3 load megart's cp3 store (what they hold) and save their
    own, which megart resumes on one rank."""
    import megatron_dist_distopt_workers as w

    _, store, _, _ = runs["cp3-distopt-to-one"]
    nproc, flags = SCENARIOS["cp3-distopt-to-one"][0]
    theirs = tmp_path_factory.mktemp("megatron") / "ckpt"
    held = launch(w.load_and_save, nproc, _plain(flags), str(store), str(theirs), timeout=300)
    resumed = tw.holding(1, dict(seq_length=24, train_iters=4, load=str(theirs)))
    return held, theirs, resumed


def test_megatron_core_at_cp3_holds_megarts_state(runs, megatron):
    """Each piece Megatron-Core's DistributedOptimizer holds (sharded over its data x
    context-parallel group of 3) equals megart's state at the save, bitwise; the three
    ranks' pieces tile every parameter; its step is megart's."""
    from megart.models.megatron_names import to_megatron

    _, store, trained, _ = runs["cp3-distopt-to-one"]
    common = read_common(iteration_dir(store, 2))
    cfg = model_config_of(common)
    whole = {}
    for key in ("weights", *MOMENTS):
        merged = {k.removeprefix("chunk."): v for k, v in tw.merged_by_place(trained, key).items()}
        whole[key] = {n: t.reshape(-1) for n, t in to_megatron(merged, cfg).items()}
    held, _, _ = megatron
    assert sorted(rank["place"][2] for rank in held) == [0, 1, 2]  # data x cp ranks
    covered: dict[str, list] = {}
    for rank in held:
        assert rank["steps"] == {2.0}
        for (chunk, local), piece in rank["pieces"].items():
            start, end = piece["range"]
            full = _global_name(local, chunk, 0, common["args"])
            for ours, theirs in (("weights", "param"), *((m, m) for m in MOMENTS)):
                want = whole[ours][full][start:end]  # past the vocabulary: padding rows
                got = piece[theirs]
                assert (got[: want.numel()] == want).all(), (local, theirs, start)
                assert not got[want.numel() :].any(), (local, theirs)
            covered.setdefault(full, []).append((start, end))
    assert len(covered) == len(whole["weights"])
    for full, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0, full
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), full
        assert ranges[-1][1] >= whole["weights"][full].numel(), full


def test_megart_writes_the_store_megatron_core_writes_at_cp3(runs, megatron):
    """The same keys (megart's adds only its random states), global sizes and dtypes, and
    the same objects: the buckets' lengths padded for 3 ranks, the param groups."""
    ours = iteration_dir(runs["cp3-distopt-to-one"][1], 2)
    theirs = iteration_dir(megatron[1], 2)
    assert_same_store(ours, theirs, ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded"))
    padded = read_object(ours, f"{GROUP0}per_bucket_numel/shard_0_1")
    assert all(n % 384 == 0 for buffer in padded for sizes in buffer.values() for n in sizes)


def test_megart_resumes_megatron_cores_cp3_store_on_the_curve(runs, megatron):
    straight, _, trained, _ = runs["cp3-distopt-to-one"]
    _, _, resumed = megatron
    tw.assert_resumed_on_curve(straight, resumed, rel=REL, abs=0)
    tw.assert_holds(trained, resumed)
