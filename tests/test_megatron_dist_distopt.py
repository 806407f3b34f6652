"""megart train --save --ckpt-format torch_dist --use-distributed-optimizer: the distributed
optimizer's state in Megatron-LM's default layout for it (DistributedOptimizer's
"dp_reshardable": per bucket of its buffers, each data-parallel rank writing its own slices).
--load resumes it on another data-parallel size, with or without the distributed optimizer,
on the uninterrupted loss curve; another tensor/pipeline layout is refused, as Megatron-LM
refuses it; Megatron-Core's own DistributedOptimizer reads megart's store and megart reads
Megatron-Core's."""

import pickle

import pytest
import torch

import train_workers as tw
from megart.launcher import LaunchError, launch
from megart.training.checkpoint import iteration_dir
from megart.training.megatron_dist import read_common
from megart.training.megatron_dist_distopt import read_object

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

# A data-parallel change reorders floating-point sums (test_megatron_dist_save: REL).
REL = 5e-6
MOMENTS = ("exp_avg", "exp_avg_sq")
GROUP0 = "optimizer.distributed.dp_group_idx_0."
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             disable_bias_linear=True, untie_embeddings_and_output_weights=True,
             group_query_attention=True, num_query_groups=2, ffn_hidden_size=48)  # fmt: skip
SAVE = dict(use_distributed_optimizer=True, ckpt_format="torch_dist")
FP16 = dict(fp16=True, initial_loss_scale=1024)
SCENARIOS = {  # name: (saving ranks, flags), (resuming ranks, flags)
    # dp2 with the distributed optimizer to one rank's plain Adam; fp16's loss scaler (a low
    # first scale, so that both iterations step) goes through the group's grad_scaler object.
    "dp2-fp16-to-dp1": ((2, dict(SAVE, **FP16)), (1, FP16)),
    # tp2 x dp2, Llama-style (SwiGLU's two halves of fc1 in one Megatron parameter), bf16
    # (fp32 main weights in the buckets, bf16 model tensors), to tp2 x dp1 distributed.
    "llama-tp2-dp2-bf16-to-dp1": (
        (4, dict(SAVE, tensor_model_parallel_size=2, bf16=True, **LLAMA)),
        (2, dict(tensor_model_parallel_size=2, bf16=True, use_distributed_optimizer=True,
                 **LLAMA)),
    ),
}  # fmt: skip


def _run(nproc, kw):
    return launch(tw.train_holding, nproc, kw, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per scenario: the uninterrupted 4 iterations, the store after 2 and what the saving
    ranks held then, and the run resumed from the store."""
    out = {}
    for name, ((n_save, save), (n_run, run)) in SCENARIOS.items():
        store = tmp_path_factory.mktemp(name) / "ckpt"
        plain = {k: v for k, v in save.items() if k not in SAVE}
        straight = _run(n_save, dict(plain, train_iters=4))[0]["history"]
        saving = _run(n_save, dict(save, train_iters=4, exit_interval=2, save=str(store)))
        resumed = _run(n_run, dict(run, train_iters=4, load=str(store)))
        out[name] = straight, store, [r["trained"] for r in saving], resumed
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_continues_the_uninterrupted_curve(runs, name):
    straight, _, _, resumed = runs[name]
    tw.assert_resumed_on_curve(straight, resumed, rel=REL, abs=0)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_holds_exactly_what_was_saved(runs, name):
    _, _, trained, resumed = runs[name]
    loaded = tw.assert_holds(trained, resumed)
    assert all(rank["steps"] == {2.0} for rank in loaded)


def test_store_is_megatrons_dp_reshardable_layout(runs):
    root = iteration_dir(runs["llama-tp2-dp2-bf16-to-dp1"][1], 2)
    # Every rank wrote: data-parallel rank 1 its slices of the buckets.
    names = sorted(p.name for p in root.iterdir() if p.suffix == ".distcp")
    assert names == [f"__{r}_0.distcp" for r in range(4)]
    common = read_common(root)
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    meta = pickle.loads((root / ".metadata").read_bytes()).state_dict_metadata
    assert not any(k.startswith("optimizer.state.") for k in meta)
    for group in (0, 1):  # tensor-parallel ranks 0 and 1: model-parallel groups 0 and 1
        prefix = f"optimizer.distributed.dp_group_idx_{group}.gbuf_idx_0."
        prefix += "dtype_(torch.bfloat16, torch.float32).bucket_idx_0."
        for state in ("param", *MOMENTS):
            info = meta[prefix + state]
            assert info.properties.dtype == torch.float32 and len(info.size) == 1
        assert f"optimizer.distributed.dp_group_idx_{group}.optimizer/shard_0_1" in meta
    assert meta["decoder.layers.self_attention.linear_qkv.weight"].properties.dtype == (
        torch.bfloat16
    )


def test_another_tensor_parallel_layout_is_refused_by_name(runs):
    store = runs["dp2-fp16-to-dp1"][1]
    with pytest.raises(LaunchError, match="ConfigError: .*dp_reshardable.*--no-load-optim"):
        _run(2, dict(FP16, train_iters=4, load=str(store), tensor_model_parallel_size=2))


@pytest.fixture(scope="module")
def megatron(runs, tmp_path_factory):
    """Megatron-Core's DistributedOptimizer on the saving layout (dp2) loads megart's dp2
    store and saves its own; megart resumes that one on one rank."""
    import megatron_dist_distopt_workers as w

    _, store, _, _ = runs["dp2-fp16-to-dp1"]
    theirs = tmp_path_factory.mktemp("megatron") / "ckpt"
    held = launch(w.load_and_save, 2, FP16, str(store), str(theirs), timeout=300)
    return held, theirs, _run(1, dict(FP16, train_iters=4, load=str(theirs)))


def test_megatron_core_distributed_optimizer_holds_megarts_state(runs, megatron):
    """Each piece Megatron-Core's DistributedOptimizer holds after loading megart's store
    (fp32 main copy, both moments; its own ranges over its own buffers) equals megart's
    state at the save, bitwise; the pieces of the two data-parallel ranks tile every
    parameter; its step is megart's."""
    from megart.models.megatron_names import to_megatron

    _, store, trained, _ = runs["dp2-fp16-to-dp1"]
    cfg = model_config_of(read_common(iteration_dir(store, 2)))
    whole = {}
    for key in ("weights", *MOMENTS):
        merged = {k.removeprefix("chunk."): v for k, v in tw.merged_by_place(trained, key).items()}
        whole[key] = to_megatron(merged, cfg)
    held, _, _ = megatron
    saved_scaler = read_object(iteration_dir(store, 2), GROUP0 + "grad_scaler/shard_0_1")
    covered: dict[str, list] = {}
    for rank in held:
        assert rank["steps"] == {2.0}
        assert float(rank["scaler"]["scale"]) == float(saved_scaler["scale"]) == 1024.0
        assert rank["scaler"]["growth_tracker"] == saved_scaler["growth_tracker"]
        assert rank["content"]["distrib_optim_sharding_type"] == "dp_reshardable"
        for name, piece in rank["pieces"].items():
            start, end = piece["range"]
            for ours, theirs in (("weights", "param"), *((m, m) for m in MOMENTS)):
                want = whole[ours][name].reshape(-1)[start:end]
                assert torch.equal(piece[theirs], want), (name, theirs, start)
            covered.setdefault(name, []).append((start, end))
    assert set(covered) == set(whole["weights"])
    for name, ranges in covered.items():
        ranges.sort()
        numel = whole["weights"][name].numel()
        assert ranges[0][0] == 0 and ranges[-1][1] == numel, name
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), name


def test_megart_resumes_megatron_cores_store_on_the_curve(runs, megatron):
    """What Megatron-Core saved (its own dp_reshardable store of the state it loaded) resumes
    in megart on one rank on the uninterrupted curve, holding megart's saved state exactly."""
    straight, _, trained, _ = runs["dp2-fp16-to-dp1"]
    _, _, resumed = megatron
    tw.assert_resumed_on_curve(straight, resumed, rel=REL, abs=0)
    tw.assert_holds(trained, resumed)


def model_config_of(common):
    from megart.training.checkpoint import model_config

    return model_config({"model_config": common["megart"]["model_config"]})


def test_megart_writes_the_store_megatron_core_writes(runs, megatron):
    """The same keys, global sizes and dtypes (megart's store adds only its random states),
    the same objects (param groups with their step, the buckets' lengths, the grad scaler),
    and the same common.pt optimizer entry and content metadata."""
    ours = iteration_dir(runs["dp2-fp16-to-dp1"][1], 2)
    theirs = iteration_dir(megatron[1], 2)
    meta = [
        pickle.loads((r / ".metadata").read_bytes()).state_dict_metadata for r in (ours, theirs)
    ]
    assert set(meta[0]) - set(meta[1]) == {"rng_state/shard_0.0_1.1"}
    assert set(meta[1]) <= set(meta[0])
    for key, info in meta[1].items():
        if hasattr(info, "size"):
            assert (meta[0][key].size, meta[0][key].properties.dtype) == (
                info.size, info.properties.dtype), key  # fmt: skip
    for name in ("optimizer", "grad_scaler", "per_bucket_numel", "per_bucket_numel_unpadded"):
        key = f"{GROUP0}{name}/shard_0_1"
        assert read_object(ours, key) == read_object(theirs, key), name
    common = [read_common(r) for r in (ours, theirs)]
    assert common[0]["optimizer"] == common[1]["optimizer"]
    assert common[0]["content_metadata"] == common[1]["content_metadata"]
