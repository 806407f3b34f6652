"""Megatron-LM's files of the distributed optimizer under expert parallelism in three layouts on 4
ranks (LAYOUTS: ep2 x pp2 x dp2; ep2 x dp4 with --bf16; ep2 x tp2 x dp2 with
--sequence-parallel, the experts split over tp), in both formats (legacy distrib_optim.pt:
training.megatron_expert_distopt; torch_dist: training.megatron_dist_chain), against
Megatron-Core 0.16.1's own model and chained DistributedOptimizers, MoE layers on both stages at
pp2 (folders mp_rank_TT[_PPP]_EEE, the experts' optimizer numbered by its place in the expert
tp-ep-pp group): Megatron-Core loads megart's files holding megart's fp32 weights and moments
bitwise (each tensor-parallel rank's pieces), writes the same, and megart resumes what it wrote
on the curve (the one-process one; the layout's own under --bf16 or tp2). A stage without MoE
layers (--moe-layer-freq [1,1,0,0]) is refused by name: Megatron-Core gives it an experts'
optimizer with an empty param group, which megart's files leave out (its load raised KeyError on
the group's key), and on the CPU (no Transformer Engine or Apex) Megatron-Core cannot save that
optimizer itself (with the non-distributed optimizer megart writes that group:
tests/test_moe_ep_megatron_stages.py)."""

import pytest
import torch

import moe_ep_megatron_distopt_workers as mw
import train_workers as tw
from megart.launcher import launch
from megart.training.checkpoint import iteration_dir
from megart.training.megatron_dist import read_common
from megart.training.megatron_files import torch_load
from moe_ep_workers import TRAIN
from train_workers import SAME_RUN

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

EP2 = dict(TRAIN, use_distributed_optimizer=True, expert_model_parallel_size=2)
RUN = dict(EP2, pipeline_model_parallel_size=2)
# Each on 4 ranks: ep2 x pp2 x dp2; ep2 x dp4 with --bf16 (fp32 main weights in the buffers);
# ep2 x tp2 x dp2 with --sequence-parallel (each expert split over tp, one expert-data rank).
LAYOUTS = {"pp2": RUN, "bf16": dict(EP2, bf16=True),
           "tp2": dict(EP2, tensor_model_parallel_size=2, sequence_parallel=True)}  # fmt: skip
ITER = "iter_0000002"


def _folders(run: dict) -> list[str]:
    """Megatron-LM's rank folders of the layout (mp_rank_TT[_PPP]_EEE)."""
    tp = run.get("tensor_model_parallel_size", 1)
    pp = run.get("pipeline_model_parallel_size", 1)
    return [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + f"_{e:03d}"
            for t in range(tp) for p in range(pp) for e in range(2)]  # fmt: skip


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    return request.param


@pytest.fixture(scope="module")
def curve(layout, moe_one_process):
    """The curve the layout's resumed runs follow: the one-process one of the same model;
    under --bf16 or tensor parallelism the layout's own uninterrupted run (its rounding)."""
    if layout == "pp2":
        return moe_one_process
    return launch(tw.train_kw, 4, LAYOUTS[layout], timeout=300)[0]


@pytest.fixture(scope="module")
def legacy(layout, tmp_path_factory):
    """megart's legacy save after 2 of 4 iterations, its own save (the reference) and
    Megatron-Core's load of the first (writing its own)."""
    run = LAYOUTS[layout]
    tmp = tmp_path_factory.mktemp(f"legacy-{layout}")
    ours, ref, theirs = tmp / "megart", tmp / "ref", tmp / "megatron"
    saving = tw.holding(4, dict(run, ckpt_format="torch", exit_interval=2, save=str(ours)))
    launch(tw.train_kw, 4, dict(run, exit_interval=2, save=str(ref)), timeout=300)
    loaded = launch(mw.load_and_write, 4, run, [str(ours)], str(ref), str(theirs), timeout=300)
    return dict(ours=ours, theirs=theirs, trained=[r["trained"] for r in saving],
                loaded=[r[0] for r in loaded])  # fmt: skip


def test_legacy_megatron_cores_chain_holds_megarts_state_bitwise(layout, legacy):
    stages = set()
    for loaded in legacy["loaded"]:
        assert "error" not in loaded, loaded
        stages.add(loaded["stage"])
        for name, piece in loaded["pieces"].items():
            assert all(piece["same"].values()), (loaded["rank"], name, piece)
        assert any("local_experts" in n for n in loaded["pieces"]), loaded["stage"]
    assert stages == set(range(LAYOUTS[layout].get("pipeline_model_parallel_size", 1)))


def test_legacy_files_are_megatron_cores(layout, legacy):
    """The same files in every folder, each rank file's optimizer a chain of two, its model in
    the run's precision, the vectors bitwise."""
    for folder in _folders(LAYOUTS[layout]):
        names = [sorted(p.name for p in (legacy[w] / ITER / folder).glob("*.pt"))
                 for w in ("ours", "theirs")]  # fmt: skip
        assert names[0] == names[1], (folder, names)
        assert names[0] == [mw.DISTRIB, mw.FILE], folder
        state = torch_load(legacy["ours"] / ITER / folder / mw.FILE)
        optimizer = state["optimizer"]
        assert isinstance(optimizer, list) and len(optimizer) == 2, folder
        half = torch.bfloat16 if LAYOUTS[layout].get("bf16") else torch.float32
        assert {v.dtype for v in state["model"].values() if torch.is_tensor(v)} == {half}
        mw.assert_same_vectors(
            *(legacy[w] / ITER / folder / mw.DISTRIB for w in ("ours", "theirs"))
        )


def test_megart_resumes_megatron_cores_legacy_files_on_the_curve(layout, legacy, curve):
    resumed = tw.holding(4, dict(LAYOUTS[layout], load=str(legacy["theirs"])))
    tw.assert_holds(legacy["trained"], resumed)
    tw.assert_resumed_on_curve(curve, [resumed[0]], **SAME_RUN)


@pytest.fixture(scope="module")
def dist(layout, tmp_path_factory):
    """megart's torch_dist save after 2 of 4 iterations and Megatron-Core's load of it
    (saving its own)."""
    import megatron_dist_ep_distopt_workers as w

    run = LAYOUTS[layout]
    tmp = tmp_path_factory.mktemp(f"dist-{layout}")
    ours, theirs = tmp / "megart", tmp / "megatron"
    saving = tw.holding(4, dict(run, ckpt_format="torch_dist", exit_interval=2, save=str(ours)))
    loaded = launch(w.load_and_save, 4, run, str(ours), str(theirs), timeout=300)
    return dict(ours=ours, theirs=theirs, trained=[r["trained"] for r in saving], loaded=loaded)


def test_dist_megatron_cores_chain_holds_megarts_state_bitwise(layout, dist):
    """Every piece Megatron-Core's optimizers hold is megart's state bitwise (the one-chunk
    model's names, each tensor-parallel rank's piece: test_megatron_dist_ep_distopt's
    comparison), each stage's parts as
    get_megatron_optimizer builds them."""
    from test_megatron_dist_distopt import model_config_of
    from test_megatron_dist_ep_distopt import KEYS, _whole

    cfg = model_config_of(read_common(iteration_dir(dist["ours"], 2)))
    tp = LAYOUTS[layout].get("tensor_model_parallel_size", 1)
    wholes = [_whole(dist["trained"], cfg, tp, t) for t in range(tp)]
    for rank in dist["loaded"]:
        assert rank["groups"] == [[False, False], [True]]
        assert rank["steps"] == {2.0}
        whole = wholes[rank["place"][0]]  # its tensor-parallel rank's pieces
        for (_, name, _), piece in rank["pieces"].items():
            start, end = piece["range"]
            for key in KEYS.values():
                want, got = whole[key][name][start:end], piece[key]
                assert torch.equal(got[: want.numel()], want), (name, key)


def test_dist_store_is_megatron_cores(layout, dist):
    """The same keys, sizes and objects of every optimizer's groups: the dense ones numbered
    by the rank's tensor and pipeline place, the experts' by its expert one too (at pp2 four
    groups)."""
    from test_megatron_dist_distopt import assert_same_store
    from test_megatron_dist_ep_distopt import _meta

    run = LAYOUTS[layout]
    mp = run.get("tensor_model_parallel_size", 1) * run.get("pipeline_model_parallel_size", 1)
    ours, theirs = iteration_dir(dist["ours"], 2), iteration_dir(dist["theirs"], 2)
    prefixes = {k[: k.index(".", k.index("dp_group_idx_")) + 1]
                for k in _meta(ours) if "dp_group_idx_" in k}  # fmt: skip
    group = "optimizer.distributed.dp_group_idx_"
    assert prefixes == {f"chained_0.{group}{g}." for g in range(mp)} | {
        f"chained_1.{group}{g}." for g in range(2 * mp)
    }, prefixes
    objects = ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded")
    pp = run.get("pipeline_model_parallel_size", 1)
    tp = run.get("tensor_model_parallel_size", 1)
    assert_same_store(ours, theirs, objects, tuple(sorted(prefixes)), pp=pp, tp=tp)


def test_megart_resumes_megatron_cores_store_on_the_curve(layout, dist, curve):
    assert "megart" not in read_common(iteration_dir(dist["theirs"], 2))
    resumed = tw.holding(4, dict(LAYOUTS[layout], load=str(dist["theirs"])))
    tw.assert_holds(dist["trained"], resumed)
    tw.assert_resumed_on_curve(curve, [resumed[0]], **SAME_RUN)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_stage_without_moe_layers_is_refused_by_name(tmp_path, ckpt_format):
    from megart import ConfigError

    run = dict(RUN, moe_layer_freq="[1,1,0,0]", ckpt_format=ckpt_format, save=str(tmp_path))
    with pytest.raises(ConfigError, match="pipeline rank 1 holds no MoE layer"):
        tw.tiny(**run).check(8)
    tw.tiny(**dict(run, moe_layer_freq="[1,0,1,0]")).check(8)  # a MoE layer on each stage
    tw.tiny(**dict(run, ckpt_format="megart")).check(8)
