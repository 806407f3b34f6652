"""The distributed optimizer's state in Megatron-LM's torch_dist store under expert parallelism
(--ckpt-format torch_dist --use-distributed-optimizer --expert-model-parallel-size 2 at dp4),
both ways, against Megatron-Core 0.16.1's own EP2 model and ChainedOptimizer of two
DistributedOptimizers: the store holds the chain's dp_reshardable buckets, the dense ones under
``chained_0.`` numbered by the model-parallel rank and sharded over data parallelism, each
expert-parallel rank's experts' under ``chained_1.`` numbered by its place in the expert tensor
x expert x pipeline group and sharded over its expert-data-parallel ranks. Megatron-Core loads
megart's store holding its fp32 weights and moments bitwise; its own save of them is megart's
store and resumes in megart at ep2, ep1 and ep4 exactly and on the one-process curve. The
mistakes (the experts' buckets sharded over dp, numbered by the model-parallel rank, the chain's
labels swapped) are caught."""

import pickle
import re

import pytest
import torch

import train_workers as tw
from megart.launcher import LaunchError, launch
from megart.training.checkpoint import iteration_dir
from megart.training.megatron_dist import read_common
from megart.training.megatron_dist_distopt import read_object
from moe_ep_workers import TRAIN
from train_workers import SAME_RUN

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

ZERO = dict(TRAIN, use_distributed_optimizer=True)
EP2 = dict(ZERO, expert_model_parallel_size=2)
SAVE = dict(EP2, ckpt_format="torch_dist")
KEYS = {"weights": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
DENSE, EXPERTS = "chained_0.optimizer.distributed.", "chained_1.optimizer.distributed."
OBJECTS = ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded")
RESUMED = [(4, EP2), (1, TRAIN), (4, dict(ZERO, expert_model_parallel_size=4))]
IDS = ["ep2-dp4", "ep1", "ep4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    store = tmp_path_factory.mktemp("ep2-dp4") / "ckpt"
    saving = tw.holding(4, dict(SAVE, exit_interval=2, save=str(store)))
    return store, [r["trained"] for r in saving]


def _meta(root) -> dict:
    return pickle.loads((root / ".metadata").read_bytes()).state_dict_metadata


def test_the_store_holds_megatron_cores_chain_of_two_distributed_optimizers(saved):
    store, _ = saved
    root = iteration_dir(store, 2)
    common = read_common(root)
    sharding = {"param_state_sharding_type": "dp_reshardable"}
    assert common["optimizer"] == {0: sharding, 1: sharding}
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    meta = _meta(root)
    optimizer = {k for k in meta if "optimizer" in k}
    assert optimizer and all(k.startswith((DENSE, EXPERTS)) for k in optimizer)
    # One dense group (tp1 x pp1), one experts' group per expert-parallel rank.
    assert {re.match(r"chained_\d\.optimizer\.distributed\.dp_group_idx_\d+", k)[0]
            for k in optimizer} == {DENSE + "dp_group_idx_0", EXPERTS + "dp_group_idx_0",
                                    EXPERTS + "dp_group_idx_1"}  # fmt: skip
    for e in (0, 1):
        prefix = f"{EXPERTS}dp_group_idx_{e}."
        groups = read_object(root, prefix + "optimizer/shard_0_1")["param_groups"]
        assert [(g["is_expert_parallel"], g["step"]) for g in groups] == [(True, 2.0)]
        padded = read_object(root, prefix + "per_bucket_numel/shard_0_1")
        assert all(n % 128 == 0 for b in padded for sizes in b.values() for n in sizes)
    dense = read_object(root, DENSE + "dp_group_idx_0.optimizer/shard_0_1")["param_groups"]
    assert [g["is_expert_parallel"] for g in dense] == [False, False]


@pytest.mark.parametrize("nproc,run", RESUMED, ids=IDS)
def test_megarts_store_resumes_on_the_curve(saved, moe_one_process, nproc, run):
    store, trained = saved
    resumed = tw.holding(nproc, dict(run, load=str(store)))
    loaded = tw.assert_holds(trained, resumed)
    assert all(rank["steps"] == {2.0} for rank in loaded)
    tw.assert_resumed_on_curve(moe_one_process, [resumed[0]], **SAME_RUN)


@pytest.fixture(scope="module")
def megatron_core(saved, tmp_path_factory):
    import megatron_dist_ep_distopt_workers as w

    store, _ = saved
    out = tmp_path_factory.mktemp("mcore") / "ckpt"
    return out, launch(w.load_and_save, 4, EP2, str(store), str(out), timeout=300)


def _whole(trained, cfg, tp: int = 1, t: int = 0) -> dict:
    """megart's saved state per key of KEYS' values: the one-chunk model's Megatron names
    (experts by global number), flattened; at ``tp`` > 1 tensor-parallel rank ``t``'s piece
    of each (the vocabulary padded to ``tp`` ranks first, as Megatron-Core holds it)."""
    from megart.models.megatron_names import to_megatron
    from megart.training.megatron_layout import OUTPUT, WORD, shard

    def piece(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tp == 1:
            return tensor
        if name in (WORD, OUTPUT):
            pad = cfg.padded_vocab_size(tp) - tensor.shape[0]
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, pad))
        return shard(name, tensor, cfg, tp, t)

    out = {}
    for ours, theirs in KEYS.items():
        merged = {k.removeprefix("chunk."): v for k, v in tw.merged_by_place(trained, ours).items()}
        out[theirs] = {n: piece(n, w).reshape(-1) for n, w in to_megatron(merged, cfg).items()}
    return out


def test_megatron_cores_chain_holds_megarts_state_bitwise(saved, megatron_core):
    """Every piece each optimizer of Megatron-Core's chain holds (its own ranges over its own
    buffers) is megart's state at the save bitwise, at step 2; the dense pieces tile each
    parameter over all ranks, the experts' over their expert-data-parallel group."""
    from test_megatron_dist_distopt import model_config_of

    store, trained = saved
    _, results = megatron_core
    whole = _whole(trained, model_config_of(read_common(iteration_dir(store, 2))))
    covered: dict = {}
    for rank in results:
        assert rank["steps"] == {2.0}
        assert rank["groups"] == [[False, False], [True]]
        for (part, name, _), piece in rank["pieces"].items():
            start, end = piece["range"]
            for key in KEYS.values():
                want, got = whole[key][name][start:end], piece[key]  # past it: padding rows
                assert torch.equal(got[: want.numel()], want), (name, key)
                assert not got[want.numel() :].any(), (name, key)
            covered.setdefault((part, name), []).append((start, end, piece["numel"]))
    assert {p for p, _ in covered} == {0, 1}
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in {
        n for _, n in covered
    }
    for (part, name), ranges in covered.items():
        ranges.sort()
        # Each expert-data-parallel group (2 of the 4 ranks) holds its experts once.
        assert ranges[0][0] == 0 and ranges[-1][1] == ranges[-1][2], name
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), name
        assert part == 1 or "local_experts" not in name


def test_megatron_core_writes_the_store_megart_writes(saved, megatron_core):
    """The same keys, global sizes and dtypes (megart adds only its random states), the same
    objects of every group of the chain, and the same common.pt optimizer and metadata."""
    from test_megatron_dist_distopt import assert_same_store

    ours, theirs = iteration_dir(saved[0], 2), iteration_dir(megatron_core[0], 2)
    groups = (DENSE + "dp_group_idx_0.", EXPERTS + "dp_group_idx_0.", EXPERTS + "dp_group_idx_1.")
    assert_same_store(ours, theirs, OBJECTS, groups)
    common = [read_common(r) for r in (ours, theirs)]
    assert common[0]["optimizer"] == common[1]["optimizer"]
    assert common[0]["content_metadata"] == common[1]["content_metadata"]


@pytest.mark.parametrize("nproc,run", RESUMED, ids=IDS)
def test_megart_resumes_megatron_cores_store_on_the_curve(
    saved, megatron_core, moe_one_process, nproc, run
):
    _, trained = saved
    out, _ = megatron_core
    assert "megart" not in read_common(iteration_dir(out, 2))
    resumed = tw.holding(nproc, dict(run, load=str(out)))
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(moe_one_process, [resumed[0]], **SAME_RUN)


def test_experts_numbered_by_the_model_parallel_rank_are_caught_by_the_save(tmp_path):
    """The experts' optimizer numbered by the rank's place in the model-parallel group, as the
    dense one (both expert-parallel ranks' experts in one group's buckets and objects): the
    save refuses the store, whose group 0's objects two ranks wrote."""
    import megatron_dist_ep_distopt_workers as w

    kw = dict(SAVE, train_iters=2, save=str(tmp_path / "ckpt"))
    raised = launch(w.save_with_mistake, 4, kw, "experts-by-mp-rank", timeout=300)
    said = r"more than one rank wrote the object chained_1\.optimizer\.distributed\.dp_group_idx_0"
    assert re.search(said, raised[0]), raised


@pytest.mark.parametrize(
    "mistake,said,megatron",
    [("experts-over-dp", r"holds no chained_1\.optimizer\.distributed\.dp_group_idx_1\.per_b",
      r"Missing key .*chained_1\.optimizer\.distributed\.dp_group_idx_1\.optimizer"),
     ("swapped-chain", r"chained_0\.optimizer\.distributed\.dp_group_idx_0\.'s buckets hold",
      r"Global shape mismatch .* key chained_0\.optimizer\.distributed\.dp_group_idx_0\.")],
)  # fmt: skip
def test_mistakes_that_tile_are_caught_by_megatron_core_and_megart(
    tmp_path, mistake, said, megatron
):
    """The experts' buckets sharded over data parallelism (the second expert-parallel rank's
    group has no data-parallel rank 0 to write its objects), or the chain's labels swapped
    (the experts' optimizer under ``chained_0.``): the store tiles, but Megatron-Core's chain
    does not find what it asks for, and megart refuses it by name."""
    import megatron_dist_ep_distopt_workers as w

    store = tmp_path / "ckpt"
    kw = dict(SAVE, exit_interval=2, save=str(store))
    assert launch(w.save_with_mistake, 4, kw, mistake, timeout=300) == [""] * 4
    with pytest.raises(LaunchError, match=megatron):
        launch(w.load_and_save, 4, EP2, str(store), None, timeout=300)
    with pytest.raises(LaunchError, match=f"ConfigError: .*{said}"):
        tw.holding(4, dict(EP2, load=str(store)))
