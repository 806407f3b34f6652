"""A pipeline stage without MoE layers under expert parallelism (ep2 x pp2, --moe-layer-freq
[1,1,0,0]: stage 1 holds dense layers only) with the non-distributed optimizer, in Megatron-LM's
legacy files and torch_dist stores, against Megatron-Core 0.16.1's own model and chain of two
FP32Optimizers. Megatron-Core's _get_param_groups gathers every rank's groups' keys, so stage
1's experts' optimizer holds one empty group (the experts' decayed weights'); megart's rank file
holds it too (megatron_expert_files.experts_groups; it left it out, and Megatron-Core's load
raised "loaded state dict has a different number of parameter groups"). Megatron-Core loads
megart's files and store, writes its own, and megart resumes those holding exactly what it saved
and on the one-process curve of the same model. The distributed optimizer in this layout stays
refused (tests/test_moe_ep_megatron_layouts.py)."""

import pytest

import train_workers as tw
from megart.launcher import launch
from megart.training.megatron_files import torch_load
from moe_ep_workers import TRAIN
from train_workers import SAME_RUN

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

RUN = dict(TRAIN, expert_model_parallel_size=2, pipeline_model_parallel_size=2,
           moe_layer_freq="[1,1,0,0]")  # fmt: skip
ITER = "iter_0000002"
FILE = "model_optim_rng.pt"


@pytest.fixture(scope="module")
def curve():
    """The one-process curve of the model with MoE layers 0 and 1 only."""
    return launch(tw.train_kw, 1, dict(TRAIN, moe_layer_freq="[1,1,0,0]"), timeout=300)[0]


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """megart's legacy save after 2 of 4 iterations and Megatron-Core's load of it (writing
    its own files)."""
    import moe_ep_megatron_workers as mw

    tmp = tmp_path_factory.mktemp("legacy")
    ours, theirs = tmp / "megart", tmp / "megatron"
    run = dict(RUN, ckpt_format="torch")
    saving = tw.holding(4, dict(run, exit_interval=2, save=str(ours)))
    groups = launch(mw.megatron_core_resaves, 4, run, str(ours), str(theirs), timeout=300)
    return dict(ours=ours, theirs=theirs, trained=[r["trained"] for r in saving], groups=groups)


def _groups(optimizer: list) -> list:
    """Each optimizer of a file's chain: its groups' sizes and keys (hyperparameters aside)."""
    keys = ("is_expert_parallel", "wd_mult", "lr_mult", "is_decoupled_lr", "default_config")
    return [[(len(g["params"]), *(g[k] for k in keys)) for g in part["param_groups"]]
            for part in optimizer]  # fmt: skip


def test_megatron_cores_chain_gives_the_dense_stage_an_empty_experts_group(legacy):
    """Stage 0 (ranks 0, 1) has its experts' one group, stage 1 (ranks 2, 3) the same group
    empty, beside its dense groups."""
    for rank, g in enumerate(legacy["groups"]):
        dense, experts = g["groups"]
        assert [x for _, x in dense] == [False, False], rank
        assert [x for _, x in experts] == [True], rank
        assert (experts[0][0] > 0) == (rank < 2), (rank, experts)


def test_megarts_files_hold_megatron_cores_groups(legacy):
    for folder in [f"mp_rank_00_{p:03d}_{e:03d}" for p in (0, 1) for e in (0, 1)]:
        ours, theirs = (torch_load(legacy[w] / ITER / folder / FILE)["optimizer"]
                        for w in ("ours", "theirs"))  # fmt: skip
        assert _groups(ours) == _groups(theirs), folder
        assert not ours[1]["state"] if folder.startswith("mp_rank_00_001") else ours[1]["state"]


def test_megart_resumes_megatron_cores_legacy_files_on_the_curve(legacy, curve):
    resumed = tw.holding(4, dict(RUN, load=str(legacy["theirs"])))
    tw.assert_holds(legacy["trained"], resumed)
    tw.assert_resumed_on_curve(curve, [resumed[0]], **SAME_RUN)


def test_megart_resumes_its_own_legacy_files_in_one_process(legacy, curve):
    """Stage 1's files' empty experts' group read back: the merged checkpoint in one process."""
    one = dict(TRAIN, moe_layer_freq="[1,1,0,0]")
    resumed = tw.holding(1, dict(one, load=str(legacy["ours"])))
    tw.assert_holds(legacy["trained"], resumed)
    tw.assert_resumed_on_curve(curve, [resumed[0]], **SAME_RUN)


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """megart's torch_dist save after 2 of 4 iterations and Megatron-Core's load of it (saving
    its own)."""
    import torch

    import megatron_dist_ep_workers as w

    tmp = tmp_path_factory.mktemp("dist")
    ours, theirs = tmp / "megart", tmp / "megatron"
    run = dict(RUN, ckpt_format="torch_dist")
    saving = tw.holding(4, dict(run, exit_interval=2, save=str(ours)))
    tokens = torch.zeros(1, 16, dtype=torch.long)  # no logits at pp 2
    loaded = launch(w.load_and_save, 4, run, str(ours), str(theirs), tokens, timeout=300)
    return dict(ours=ours, theirs=theirs, trained=[r["trained"] for r in saving], loaded=loaded)


def test_dist_megatron_cores_chain_holds_megarts_state_bitwise(dist):
    from megart.training.checkpoint import iteration_dir, model_config
    from megart.training.megatron_dist import read_common
    from test_megatron_dist_moe import assert_megatron_core_holds

    results = dist["loaded"]
    for r in results:
        r["held"]["main"] = r["held"]["model"]  # FP32Optimizer: the parameters are the mains
        dense, experts = r["groups"]
        assert [x for _, x in experts] == [True] and (experts[0][0] > 0) == (r["rank"] < 2)
    common = read_common(iteration_dir(dist["ours"], 2))
    cfg = model_config({"model_config": common["megart"]["model_config"]})
    seen = assert_megatron_core_holds(results, dist["trained"], cfg, 1)
    assert any("experts.experts.linear_fc1" in k for k in seen), seen


def test_megart_resumes_megatron_cores_store_on_the_curve(dist, curve):
    resumed = tw.holding(4, dict(RUN, load=str(dist["theirs"])))
    tw.assert_holds(dist["trained"], resumed)
    tw.assert_resumed_on_curve(curve, [resumed[0]], **SAME_RUN)
