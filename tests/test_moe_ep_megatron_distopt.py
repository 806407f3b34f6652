"""Megatron-LM's legacy distrib_optim.pt under expert parallelism (--ckpt-format torch
--use-distributed-optimizer --expert-model-parallel-size 2 at dp4: training.
megatron_expert_distopt), against Megatron-Core 0.16.1 itself. megart writes each expert-parallel
rank's folder as Megatron-Core's chained DistributedOptimizers do (the rank file's optimizer a
list of two state dicts, distrib_optim.pt the list [dense vectors, the rank's experts' vectors],
the dense ones in expert-parallel rank 0's folder only); Megatron-Core's own model and chain
(dense over dp, experts over the expert-data-parallel group) load them holding every
parameter's fp32 copy and moments bitwise as megart's own checkpoint of the run, and what they
then write is megart's files' vectors bitwise; megart resumes those files at ep2, ep1 and ep4
on the one-process curve. The mistakes caught: the chain's order swapped, and the experts'
vectors gathered over data parallelism (dp rank 0's experts in each folder) instead of each
expert-data-parallel group's."""

import shutil
from pathlib import Path

import pytest
import torch

import moe_ep_megatron_distopt_workers as mw
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.training.ckpt_files import read_file
from megart.training.megatron_files import torch_load
from train_workers import SAME_RUN

MODEL = dict(num_experts=4, disable_bias_linear=True, moe_aux_loss_coeff=0.1,
             moe_z_loss_coeff=0.01)  # fmt: skip
TRAIN = dict(MODEL, train_iters=4)
ZERO = dict(TRAIN, use_distributed_optimizer=True)
EP2 = dict(ZERO, expert_model_parallel_size=2)
LEGACY = dict(EP2, ckpt_format="torch")
FOLDERS = ["mp_rank_00_000", "mp_rank_00_001"]
ITER = "iter_0000002"


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, TRAIN, timeout=300)[0]


def _swapped(store: Path, out: Path) -> None:
    """The chain's order swapped (experts first) in every rank file and distrib_optim.pt."""
    shutil.copytree(store, out)
    for folder in FOLDERS:
        for name in (mw.FILE, mw.DISTRIB):
            path = out / ITER / folder / name
            state = torch_load(path)
            if name == mw.FILE:
                state["optimizer"] = state["optimizer"][::-1]
            else:
                state = state[::-1]
            torch.save(state, path)


def _experts_over_dp(store: Path, out: Path) -> None:
    """Each folder's experts' vectors those that gathering over data parallelism gives to its
    rank 0 (expert-parallel rank 0's experts) instead of the folder's own group's."""
    shutil.copytree(store, out)
    first = torch_load(out / ITER / FOLDERS[0] / mw.DISTRIB)
    for folder in FOLDERS[1:]:
        path = out / ITER / folder / mw.DISTRIB
        torch.save([torch_load(path)[0], first[1]], path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """megart's save at ep2 x dp4 after 2 of 4 iterations in Megatron's legacy format and in its
    own (the reference); Megatron-Core's load of the legacy one (writing its own) and of the
    two mistakes made of it."""
    tmp = tmp_path_factory.mktemp("ep2-distopt")
    ours, ref, theirs = tmp / "megart", tmp / "ref", tmp / "megatron"
    saving = tw.holding(4, dict(LEGACY, exit_interval=2, save=str(ours)))
    launch(tw.train_kw, 4, dict(EP2, exit_interval=2, save=str(ref)), timeout=300)
    _swapped(ours, tmp / "swapped")
    _experts_over_dp(ours, tmp / "experts-over-dp")
    stores = [str(p) for p in (ours, tmp / "swapped", tmp / "experts-over-dp")]
    loaded = launch(mw.load_and_write, 4, EP2, stores, str(ref), str(theirs), timeout=300)
    return dict(ours=ours, theirs=theirs, swapped=tmp / "swapped",
                trained=[r["trained"] for r in saving],
                loaded=[{s: r[i] for i, s in enumerate(("ours", "swapped", "over-dp"))}
                        for r in loaded])  # fmt: skip


def test_each_folder_holds_the_chain_as_megatron_core_writes_it(runs):
    root = runs["ours"] / ITER
    assert sorted(p.name for p in root.iterdir()) == FOLDERS
    for e, folder in enumerate(FOLDERS):
        dense, experts = torch_load(root / folder / mw.FILE)["optimizer"]
        assert all(not g["is_expert_parallel"] for g in dense["optimizer"]["param_groups"])
        assert [g["is_expert_parallel"] for g in experts["optimizer"]["param_groups"]] == [True]
        assert all("state" not in o["optimizer"] for o in (dense, experts))
        vectors = torch_load(root / folder / mw.DISTRIB)
        assert len(vectors) == 2 and vectors[1]["buckets_coalesced"]
        # Data-parallel rank 0 (expert-parallel rank 0) alone writes the dense vectors.
        assert (vectors[0] is None) == (e > 0)


def test_megatron_cores_chain_holds_megarts_state_bitwise(runs):
    for rank, loaded in enumerate(runs["loaded"]):
        ours = loaded["ours"]
        assert "error" not in ours, (rank, ours)
        for name, piece in ours["pieces"].items():
            assert all(piece["same"].values()), (rank, name, piece)
    # The pieces tile each parameter: a dense one over all ranks (data parallelism), an
    # expert one over its expert-parallel rank's (the expert-data-parallel group).
    held: dict = {}
    for loaded in runs["loaded"]:
        for name, piece in loaded["ours"]["pieces"].items():
            group = loaded["ours"]["rank"] if "local_experts" in name else None
            held.setdefault((group, name), []).append((*piece["range"], piece["numel"]))
    assert {g for g, _ in held} == {None, 0, 1}
    assert any("router" in n for _, n in held)
    for key, ranges in held.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == ranges[-1][2], (key, ranges)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), key


def test_megatron_core_writes_megarts_files_vectors_bitwise(runs):
    for folder in FOLDERS:
        mw.assert_same_vectors(*(runs[w] / ITER / folder / mw.DISTRIB for w in ("ours", "theirs")))


def test_the_mistakes_are_caught(runs):
    """The chain swapped: Megatron-Core refuses it (its dense optimizer given the experts'
    groups), and so does megart. The experts gathered over dp: the ranks of expert-parallel
    rank 1 hold other experts' moments."""
    for loaded in runs["loaded"]:
        assert "error" in loaded["swapped"], loaded["swapped"]
    print("Megatron-Core on the swapped chain:", runs["loaded"][0]["swapped"]["error"][:300])
    with pytest.raises(ConfigError):
        read_file(runs["swapped"] / ITER / FOLDERS[1] / mw.FILE)
    for loaded in runs["loaded"]:
        over = loaded["over-dp"]
        assert "error" not in over
        wrong = [n for n, p in over["pieces"].items() if not all(p["same"].values())]
        if over["rank"] == 0:
            assert not wrong
        else:
            assert wrong and all("local_experts" in n for n in wrong)


@pytest.mark.parametrize(
    "nproc,run",
    [(4, EP2), (1, ZERO), (4, dict(ZERO, expert_model_parallel_size=4))],
    ids=["ep2", "ep1", "ep4"],
)
def test_megart_resumes_megatron_cores_files_on_the_curve(runs, one_process, nproc, run):
    """Megatron-Core's files (no megart record) hold what megart saved, resharded into ep1
    and ep4 (training.expert_shards), and the run goes on on the one-process curve."""
    resumed = tw.holding(nproc, dict(run, load=str(runs["theirs"])))
    tw.assert_holds(runs["trained"], resumed)
    tw.assert_resumed_on_curve(one_process, [resumed[0]], **SAME_RUN)


def test_megart_resumes_its_own_files_on_the_curve(runs, one_process):
    resumed = tw.holding(4, dict(EP2, load=str(runs["ours"])))
    tw.assert_holds(runs["trained"], resumed)
    tw.assert_resumed_on_curve(one_process, [resumed[0]], **SAME_RUN)
