"""megart train --save --ckpt-format torch_dist --use-distributed-optimizer: the distributed
optimizer's state in Megatron-LM's default layout for it (DistributedOptimizer's
"dp_reshardable": per bucket of its buffers, each data-parallel rank writing its own slices).
--load resumes it on another data-parallel size, with or without the distributed optimizer,
and on another tensor/pipeline layout (which Megatron-LM refuses), on the uninterrupted loss
curve holding the saved state exactly; Megatron-Core's own DistributedOptimizer reads megart's
store and megart reads Megatron-Core's."""

import pickle
import shutil

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
MOE = dict(num_experts=3, moe_layer_freq="[0,1,1,1]", moe_ffn_hidden_size=24, swiglu=True,
           disable_bias_linear=True, moe_aux_loss_coeff=0.01)  # fmt: skip
FP16 = dict(fp16=True, initial_loss_scale=1024)
INTERLEAVED = dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1)
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
    # Two model chunks per rank (a buffer each: gbuf_idx 0 and 1), the tied embedding's own
    # bucket on the first and last stage, and with --overlap-grad-reduce and a small
    # --ddp-bucket-size several buckets on the first stage's first chunk; resumed on pp2
    # interleaved with one data-parallel rank and plain Adam.
    "pp2-interleaved-buckets-to-dp1": (
        (4, dict(SAVE, **INTERLEAVED, overlap_grad_reduce=True, ddp_bucket_size=3000)),
        (2, INTERLEAVED),
    ),
    # Uneven stages (1 and 3 layers), resumed on one rank: the saved buffers follow the
    # saved stages, not the resuming run's.
    "pp2-uneven-dp2-to-dp1": (
        (4, dict(SAVE, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1)),
        (1, {}),
    ),
    # Mixture of experts (a dense first layer, then MoE layers: each layer its own model key,
    # the experts among the dense parameters in Megatron's buffers at expert parallelism 1),
    # SwiGLU's halves in every expert's fc1; dp2 to one rank's plain Adam.
    "moe-dp2-to-dp1": ((2, dict(SAVE, **MOE)), (1, MOE)),
}  # fmt: skip
# Stores resumed on another tensor/pipeline layout (Megatron-LM refuses that for its
# dp_reshardable layout): name -> (the scenario's store, resuming ranks and flags).
RESHARD = {
    # bf16 Llama-style tp2 to pp2 (the untied output layer to the last stage, SwiGLU's halves
    # from each tensor-parallel rank's [gate_r; up_r]) with the distributed optimizer. bf16's
    # autocast rounds otherwise on another layout: 1.2e-5 measured from the exact state.
    "llama-tp2-to-pp2": ("llama-tp2-dp2-bf16-to-dp1",
                         (2, dict(pipeline_model_parallel_size=2, bf16=True,
                                  use_distributed_optimizer=True, **LLAMA)), 5e-5),
    # Interleaved pp2 (tied embedding copies, several buckets) to tp2: row-parallel weights
    # read in runs of a row.
    "interleaved-to-tp2": ("pp2-interleaved-buckets-to-dp1",
                           (2, dict(tensor_model_parallel_size=2)), REL),
    # The same pipeline size with even stages: other buffers though the sizes match (megart
    # once read them as this run's and refused the store).
    "uneven-to-even-pp2": ("pp2-uneven-dp2-to-dp1",
                           (2, dict(pipeline_model_parallel_size=2,
                                    use_distributed_optimizer=True)), REL),
}  # fmt: skip
# Megatron-Core's DistributedOptimizer loads these stores on their saving layouts; the first
# it also saves, for megart to resume.
MEGATRON = ("dp2-fp16-to-dp1", "pp2-interleaved-buckets-to-dp1", "moe-dp2-to-dp1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per scenario: the uninterrupted 4 iterations, the store after 2 and what the saving
    ranks held then, and the run resumed from the store."""
    out = {}
    for name, ((n_save, save), (n_run, run)) in SCENARIOS.items():
        store = tmp_path_factory.mktemp(name) / "ckpt"
        plain = {k: v for k, v in save.items() if k not in SAVE}
        straight = tw.holding(n_save, dict(plain, train_iters=4))[0]["history"]
        saving = tw.holding(n_save, dict(save, train_iters=4, exit_interval=2, save=str(store)))
        resumed = tw.holding(n_run, dict(run, train_iters=4, load=str(store)))
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


@pytest.fixture(scope="module")
def resharded(runs):
    out = {}
    for name, (source, (n_run, run), _) in RESHARD.items():
        straight, store, trained, _ = runs[source]
        out[name] = straight, trained, tw.holding(n_run, dict(run, train_iters=4, load=str(store)))
    return out


@pytest.mark.parametrize("name", list(RESHARD))
def test_another_tensor_pipeline_layout_resumes_on_the_curve_holding_the_state(resharded, name):
    straight, trained, resumed = resharded[name]
    loaded = tw.assert_holds(trained, resumed)
    assert all(rank["steps"] == {2.0} for rank in loaded)
    assert all(rank["padding"] == 0.0 for rank in loaded)
    tw.assert_resumed_on_curve(straight, resumed, rel=RESHARD[name][2], abs=0)


def test_another_sharding_type_is_refused_by_name(runs, tmp_path):
    store = tmp_path / "ckpt"
    shutil.copytree(runs["dp2-fp16-to-dp1"][1], store)
    path = iteration_dir(store, 2) / "common.pt"
    common = torch.load(path, weights_only=False)
    common["optimizer"]["param_state_sharding_type"] = "fully_reshardable"
    torch.save(common, path)
    with pytest.raises(LaunchError, match="ConfigError: .*'fully_reshardable'.*--no-load-optim"):
        tw.holding(1, dict(FP16, train_iters=4, load=str(store)))


@pytest.fixture(scope="module")
def megatron(runs, tmp_path_factory):
    """Per name in MEGATRON: Megatron-Core's ranks on the saving layout load megart's store
    (what they hold); the first saves its own, which megart resumes on one rank."""
    import megatron_dist_distopt_workers as w

    out = {}
    for i, name in enumerate(MEGATRON):
        _, store, _, _ = runs[name]
        nproc, flags = SCENARIOS[name][0]
        flags = {k: v for k, v in flags.items() if k not in SAVE}
        theirs = tmp_path_factory.mktemp("megatron") / "ckpt" if i == 0 else None
        held = launch(w.load_and_save, nproc, flags, str(store), theirs and str(theirs),
                      timeout=300)  # fmt: skip
        resumed = tw.holding(1, dict(flags, train_iters=4, load=str(theirs))) if i == 0 else None
        out[name] = held, theirs, resumed
    return out


def _global_name(name: str, chunk: int, pp_rank: int, args) -> str:
    """A Megatron-Core model chunk's parameter under the one-chunk model's name (its layer
    numbered in the whole model; the last stage's tied output layer, the word embedding)."""
    if name.startswith("decoder.layers."):
        _, _, layer, rest = name.split(".", 3)
        pp, per = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
        per = per or args.num_layers // pp
        first = (
            ((chunk * pp + pp_rank) * per)
            if args.num_layers_per_virtual_pipeline_stage
            else pp_rank * per
        )
        return f"decoder.layers.{first + int(layer)}.{rest}"
    tied = not args.untie_embeddings_and_output_weights
    return "embedding.word_embeddings.weight" if tied and name == "output_layer.weight" else name


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_core_distributed_optimizer_holds_megarts_state(runs, megatron, name):
    """Each piece Megatron-Core's DistributedOptimizer holds after loading megart's store
    (fp32 main copy, both moments; its own ranges over its own buffers) equals megart's
    state at the save, bitwise (the vocabulary's padding rows zero); the pieces of the
    data-parallel ranks tile every parameter; its step (and fp16 grad scaler) is megart's."""
    from megart.models.megatron_names import to_megatron

    _, store, trained, _ = runs[name]
    root = iteration_dir(store, 2)
    common = read_common(root)
    cfg = model_config_of(common)
    whole = {}
    for key in ("weights", *MOMENTS):
        merged = {k.removeprefix("chunk."): v for k, v in tw.merged_by_place(trained, key).items()}
        whole[key] = {n: t.reshape(-1) for n, t in to_megatron(merged, cfg).items()}
    held, _, _ = megatron[name]
    saved_scaler = read_object(root, GROUP0 + "grad_scaler/shard_0_1") if "fp16" in name else None
    covered: dict[tuple, list] = {}
    for rank in held:
        assert rank["steps"] == {2.0}
        assert rank["content"]["distrib_optim_sharding_type"] == "dp_reshardable"
        if saved_scaler is not None:
            assert float(rank["scaler"]["scale"]) == float(saved_scaler["scale"]) == 1024.0
            assert rank["scaler"]["growth_tracker"] == saved_scaler["growth_tracker"]
        t, p, _ = rank["place"]
        for (chunk, local), piece in rank["pieces"].items():
            start, end = piece["range"]
            full = _global_name(local, chunk, p, common["args"])
            for ours, theirs in (("weights", "param"), *((m, m) for m in MOMENTS)):
                want = whole[ours][full][start:end]  # past the vocabulary: padding rows
                got = piece[theirs]
                assert torch.equal(got[: want.numel()], want), (name, local, theirs, start)
                assert not got[want.numel() :].any(), (name, local, theirs)
            covered.setdefault((t, p, chunk, local), []).append((start, end))
    assert {k[3] for k in covered} >= {"decoder.layers.0.mlp.linear_fc1.weight"}
    if "moe" in name:  # each expert's slices, placed by Megatron-Core's own buffers
        expert = "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"
        assert {k[3] for k in covered} >= {expert, "decoder.layers.1.mlp.router.weight"}
    for key, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0, key
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), key
    if "buckets" in name:  # several buckets on the first stage's first chunk, as asked
        assert max(len(r["buckets"][0]) for r in held) > 2


def test_megart_resumes_megatron_cores_store_on_the_curve(runs, megatron):
    """What Megatron-Core saved (its own dp_reshardable store of the state it loaded) resumes
    in megart on one rank on the uninterrupted curve, holding megart's saved state exactly."""
    straight, _, trained, _ = runs["dp2-fp16-to-dp1"]
    _, _, resumed = megatron["dp2-fp16-to-dp1"]
    tw.assert_resumed_on_curve(straight, resumed, rel=REL, abs=0)
    tw.assert_holds(trained, resumed)


def model_config_of(common):
    from megart.training.checkpoint import model_config

    return model_config({"model_config": common["megart"]["model_config"]})


def assert_same_store(
    ours, theirs, objects: tuple[str, ...], groups=(GROUP0,), pp: int = 1, tp: int = 1
) -> None:
    """Two iteration directories' stores hold the same keys, global sizes and dtypes, except
    megart's random states (Megatron-LM's are CUDA streams: none from Megatron-Core's CPU
    ranks; one per stage of ``pp`` and tensor-parallel rank of ``tp``), and the same
    ``objects`` of each of ``groups`` (key prefixes; group 0's)."""
    meta = [
        pickle.loads((r / ".metadata").read_bytes()).state_dict_metadata for r in (ours, theirs)
    ]
    rng = {f"rng_state/shard_{p}.{t}_{pp}.{tp}" for p in range(pp) for t in range(tp)}
    assert set(meta[0]) - set(meta[1]) == rng
    assert set(meta[1]) <= set(meta[0])
    for key, info in meta[1].items():
        if hasattr(info, "size"):
            assert (meta[0][key].size, meta[0][key].properties.dtype) == (
                info.size, info.properties.dtype), key  # fmt: skip
    for group in groups:
        for name in objects:
            key = f"{group}{name}/shard_0_1"
            assert read_object(ours, key) == read_object(theirs, key), key


def test_megart_writes_the_store_megatron_core_writes(runs, megatron):
    """The same keys, global sizes and dtypes (megart's store adds only its random states),
    the same objects (param groups with their step, the buckets' lengths, the grad scaler),
    and the same common.pt optimizer entry and content metadata."""
    ours = iteration_dir(runs["dp2-fp16-to-dp1"][1], 2)
    theirs = iteration_dir(megatron["dp2-fp16-to-dp1"][1], 2)
    assert_same_store(ours, theirs, ("optimizer", "grad_scaler", "per_bucket_numel",
                                     "per_bucket_numel_unpadded"))  # fmt: skip
    common = [read_common(r) for r in (ours, theirs)]
    assert common[0]["optimizer"] == common[1]["optimizer"]
    assert common[0]["content_metadata"] == common[1]["content_metadata"]
