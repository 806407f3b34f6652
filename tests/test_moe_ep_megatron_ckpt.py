"""Expert parallelism in Megatron-LM's legacy checkpoint files (--ckpt-format torch at
--expert-model-parallel-size 2; training.megatron_expert_files): each expert-parallel rank
writes mp_rank_TT[_PPP]_EEE with its experts under their local numbers and its optimizer as
Megatron-Core's chain of two (dense, experts), args with expert_model_parallel_size. A save
resumes at the same layout and in one process (its files merged) holding exactly what was
saved and on the one-process curve; Megatron-Core's EP2 model loads each rank's file strictly
with megart's logits, and its ChainedOptimizer megart's state, and megart resumes the files it
writes. A torch_dist store saved at EP 1 (layout-free) resumes at EP 2 (and with the
distributed optimizer at ep2 x dp4: tests/test_moe_ep_distopt.py covers its own store). The
distributed optimizer's legacy files are written under expert parallelism too
(tests/test_moe_ep_megatron_distopt.py), and torch_dist without it (tests/test_megatron_dist_ep.py);
torch_dist with the distributed optimizer's state stays refused by name."""

import pytest

import train_workers as tw
from megart.launcher import launch
from megart.training.megatron_files import torch_load
from moe_ep_workers import TRAIN
from train_workers import SAME_RUN

EP2 = dict(TRAIN, expert_model_parallel_size=2, ckpt_format="torch")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    store = tmp_path_factory.mktemp("ep2") / "ckpt"
    saving = tw.holding(2, dict(EP2, train_iters=4, exit_interval=2, save=str(store)))
    return store, [r["trained"] for r in saving]


def test_an_ep2_pp2_legacy_checkpoint_resumes_in_one_process_on_the_curve(
    tmp_path, moe_one_process
):
    """Files mp_rank_00_PPP_EEE (Megatron's order: pipeline, then expert rank)."""
    layout = dict(EP2, pipeline_model_parallel_size=2)
    store = tmp_path / "ckpt"
    trained, resumed = tw.saved_and_resumed(4, layout, 1, TRAIN, store)
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(moe_one_process, [resumed[0]], **SAME_RUN)
    saved = sorted(p.name for p in (store / "iter_0000002").iterdir())
    assert saved == ["mp_rank_00_000_000", "mp_rank_00_000_001",
                     "mp_rank_00_001_000", "mp_rank_00_001_001"]  # fmt: skip


def test_each_expert_parallel_rank_writes_its_local_experts_as_megatron_lm(saved):
    store, _ = saved
    root = store / "iter_0000002"
    assert sorted(p.name for p in root.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    for e in range(2):
        state = torch_load(root / f"mp_rank_00_{e:03d}" / "model_optim_rng.pt")
        assert vars(state["args"])["expert_model_parallel_size"] == 2
        experts = {k.split("local_experts.")[1].split(".")[0]
                   for k in state["model"] if "local_experts" in k}  # fmt: skip
        assert experts == {"0", "1"}  # local numbers: 4 experts over 2 ranks
        dense, expert = state["optimizer"]  # Megatron-Core's ChainedOptimizer
        assert all(not g["is_expert_parallel"] for g in dense["param_groups"])
        assert [g["is_expert_parallel"] for g in expert["param_groups"]] == [True]  # no biases
        n_expert = sum(len(g["params"]) for g in expert["param_groups"])
        # Every local expert's fc1 and fc2 of every MoE layer, and nothing else.
        held = [k for k in state["model"] if "local_experts" in k and k.endswith("weight")]
        assert n_expert == len(held) and len(held) % 4 == 0


@pytest.mark.parametrize("nproc,run", [(2, EP2), (1, TRAIN)], ids=["ep2", "ep1"])
def test_an_ep2_legacy_checkpoint_resumes_on_the_curve(saved, moe_one_process, nproc, run):
    store, trained = saved
    resumed = tw.holding(nproc, dict(run, train_iters=4, load=str(store)))
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(moe_one_process, [resumed[0]], **SAME_RUN)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_lms_formats_with_the_distributed_optimizer_pass_the_checks(fmt):
    """Its chained distrib_optim.pt (tests/test_moe_ep_megatron_distopt.py) and torch_dist's
    chain of two DistributedOptimizers' buckets (tests/test_megatron_dist_ep_distopt.py)."""
    tw.tiny(**dict(EP2, ckpt_format=fmt, use_distributed_optimizer=True)).check(2)


def test_megatron_core_at_ep2_loads_each_ranks_file_with_megarts_logits(saved):
    """Each of Megatron-Core's two expert-parallel ranks loads its own file strictly; its
    logits are megart's of the merged weights (convert-checkpoint's reader). Bound 1e-6:
    Megatron-Core's routing softmax rounds to fp32."""
    import torch

    import moe_ep_megatron_workers as mw

    store, _ = saved
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    theirs = launch(mw.logits_of_own_file, 2, str(store), tokens, timeout=300)
    assert [r["file"] for r in theirs] == ["mp_rank_00_000", "mp_rank_00_001"]
    want = launch(mw.whole_logits, 1, str(store), tokens, timeout=300)[0]
    assert want.abs().max() > 0.1
    diffs = [(r["logits"][..., : want.shape[-1]] - want).abs().max().item() for r in theirs]
    print(f"Megatron-Core EP2 logits vs megart's: {diffs} (scale {want.abs().max().item():.3g})")
    assert max(diffs) < 1e-6


@pytest.fixture(scope="module")
def megatron_core_saved(saved, tmp_path_factory):
    import moe_ep_megatron_workers as mw

    store, _ = saved
    out = tmp_path_factory.mktemp("mcore") / "ckpt"
    groups = launch(mw.megatron_core_resaves, 2, EP2, str(store), str(out), timeout=300)
    return out, groups


def test_megatron_cores_chained_optimizer_loads_megarts_state(megatron_core_saved):
    """Megatron-Core's own groups of the EP2 model: the dense optimizer's two (decayed, not),
    the experts' one (no biases), flagged is_expert_parallel, as megart's file holds them."""
    _, groups = megatron_core_saved
    for g in groups:
        (dense, experts) = g["groups"]
        assert [x for _, x in dense] == [False, False] and [x for _, x in experts] == [True]
        assert experts[0][0] > 0


@pytest.mark.parametrize("nproc,run", [(2, EP2), (1, TRAIN)], ids=["ep2", "ep1"])
def test_megart_resumes_megatron_cores_ep2_files_on_the_curve(
    saved, megatron_core_saved, moe_one_process, nproc, run
):
    """Megatron-Core's files (its own model and ChainedOptimizer state dicts, no megart
    record) hold what megart saved: a resume at EP2 and in one process holds it exactly and
    goes on on the curve."""
    _, trained = saved
    out, _ = megatron_core_saved
    resumed = tw.holding(nproc, dict(run, train_iters=4, load=str(out)))
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(moe_one_process, [resumed[0]], **SAME_RUN)


@pytest.mark.parametrize(
    "nproc,run",
    [(2, dict(TRAIN, expert_model_parallel_size=2)),
     (4, dict(TRAIN, expert_model_parallel_size=2, use_distributed_optimizer=True))],
    ids=["ep2", "ep2-dp4-distopt"],
)  # fmt: skip
def test_a_torch_dist_store_of_ep1_resumes_at_ep2_on_the_curve(
    tmp_path, moe_one_process, nproc, run
):
    """Each rank reads its own experts' slices (global offsets) of the layout-free store."""
    saved = dict(TRAIN, ckpt_format="torch_dist")
    trained, resumed = tw.saved_and_resumed(1, saved, nproc, run, tmp_path / "ckpt")
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(moe_one_process, [resumed[0]], **SAME_RUN)


def test_args_saved_at_ep2_are_taken_by_every_reader():
    """Legacy files and torch_dist stores saved at EP 2 are read (one check for both;
    tests/test_megatron_dist_ep.py)."""
    from megart.training.megatron_args import check_args

    a = dict(num_layers=2, num_experts=4, expert_model_parallel_size=2)
    check_args(a, "store")
