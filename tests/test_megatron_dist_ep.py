"""Megatron-LM's torch_dist store under expert parallelism (--ckpt-format torch_dist at
--expert-model-parallel-size 2), both ways, against Megatron-Core 0.16.1's own EP2 model and
ChainedOptimizer: each expert-parallel rank writes its experts under their global numbers (the
expert-data-parallel rank 0 of each, the dense weights data-parallel rank 0), common.pt holds
the chain's two optimizers' groups; Megatron-Core loads it strictly holding megart's weights and
moments bitwise with megart's logits; its own save of them resumes in megart at ep2, ep1 and ep4
holding exactly what megart saved and on the one-process curve; megart's own store resumes at
ep1, ep4 and ep2 x dp2. Mistakes in the writing (experts at local numbers, experts written only
where the dense weights are) are caught. The distributed optimizer's state at EP > 1:
tests/test_megatron_dist_ep_distopt.py."""

import pytest
import torch

import train_workers as tw
from megart.launcher import launch
from megart.training.checkpoint import iteration_dir, model_config
from megart.training.megatron_dist import read_common
from test_moe_ep_megatron_ckpt import TRAIN
from train_workers import SAME_RUN

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # Megatron-Core's torch_dist strategy needs it

EP2 = dict(TRAIN, expert_model_parallel_size=2, ckpt_format="torch_dist")
LOGITS = 1e-6  # Megatron-Core's softmax over experts rounds to fp32


@pytest.fixture(scope="module")
def curve():
    """The uninterrupted one-process run's history."""
    return launch(tw.train_kw, 1, TRAIN, timeout=300)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    store = tmp_path_factory.mktemp("ep2") / "ckpt"
    saving = tw.holding(2, dict(EP2, exit_interval=2, save=str(store)))
    return store, [r["trained"] for r in saving]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))


def test_common_pt_holds_megatron_cores_chain_of_two_optimizers(saved):
    store, _ = saved
    common = read_common(iteration_dir(store, 2))
    assert vars(common["args"])["expert_model_parallel_size"] == 2
    assert common["content_metadata"] == {"singleton_local_shards": False,
                                          "chained_optim_avoid_prefix": True}  # fmt: skip
    dense, experts = common["optimizer"][0], common["optimizer"][1]
    assert [g["is_expert_parallel"] for g in dense["param_groups"]] == [False, False]
    assert [g["is_expert_parallel"] for g in experts["param_groups"]] == [True]  # no biases
    assert float(dense["state"]["common_step"]) == float(experts["state"]["common_step"]) == 2


@pytest.mark.parametrize(
    "nproc,run",
    [(2, dict(TRAIN, expert_model_parallel_size=2)), (1, TRAIN),
     (4, dict(TRAIN, expert_model_parallel_size=4)),
     (4, dict(TRAIN, expert_model_parallel_size=2))],
    ids=["ep2", "ep1", "ep4", "ep2-dp4"],
)  # fmt: skip
def test_megarts_ep2_store_resumes_on_the_curve(saved, curve, nproc, run):
    """Exactly what was saved (weights and moments bitwise), then the uninterrupted curve."""
    store, trained = saved
    resumed = tw.holding(nproc, dict(run, load=str(store)))
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(curve, [resumed[0]], **SAME_RUN)


def test_an_ep2_dp4_store_of_replicated_experts_resumes_in_curve(tmp_path, curve):
    """Two expert-data-parallel ranks hold each expert: one of them writes it."""
    save = dict(EP2, expert_model_parallel_size=2)
    trained, resumed = tw.saved_and_resumed(4, save, 1, TRAIN, tmp_path / "ckpt")
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(curve, [resumed[0]], **SAME_RUN)


@pytest.fixture(scope="module")
def megatron_core(saved, tmp_path_factory):
    import megatron_dist_ep_workers as w

    store, _ = saved
    out = tmp_path_factory.mktemp("mcore") / "ckpt"
    results = launch(w.load_and_save, 2, EP2, str(store), str(out), _tokens(), timeout=300)
    return out, results


def test_megatron_core_at_ep2_loads_megarts_store_holding_its_state(saved, megatron_core):
    """Each piece Megatron-Core's two ranks hold (its own sharded tensors place it: experts by
    layer and global number) equals megart's weights and moments bitwise; step 2 in both
    optimizers of its chain, whose groups are the ones common.pt holds."""
    from test_megatron_dist_moe import assert_megatron_core_holds

    store, trained = saved
    _, results = megatron_core
    for r in results:
        r["held"]["main"] = r["held"]["model"]  # FP32Optimizer: the parameters are the mains
        assert [[x for _, x in part] for part in r["groups"]] == [[False, False], [True]]
    cfg = model_config({"model_config": read_common(iteration_dir(store, 2))["megart"]
                        ["model_config"]})  # fmt: skip
    seen = assert_megatron_core_holds(results, trained, cfg, 1)
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in seen
    # Each rank holds two of the four experts, by their global numbers.
    for r in results:
        firsts = {o[1] for k, o, _, _ in r["held"]["model"] if "experts.experts" in k}
        assert firsts == {2 * r["rank"], 2 * r["rank"] + 1}


def test_megatron_cores_logits_are_megarts(saved, megatron_core):
    import moe_ep_megatron_workers as mw

    store, _ = saved
    _, results = megatron_core
    want = launch(mw.whole_logits, 1, str(store), _tokens(), timeout=300)[0]
    assert want.abs().max() > 0.1
    diffs = [(r["logits"][..., : want.shape[-1]] - want).abs().max().item() for r in results]
    print(f"Megatron-Core EP2 logits vs megart's: {diffs}")
    assert max(diffs) < LOGITS


@pytest.mark.parametrize(
    "nproc,run",
    [(2, dict(TRAIN, expert_model_parallel_size=2)), (1, TRAIN),
     (4, dict(TRAIN, expert_model_parallel_size=4))],
    ids=["ep2", "ep1", "ep4"],
)  # fmt: skip
def test_megart_resumes_megatron_cores_ep2_store_on_the_curve(
    saved, megatron_core, curve, nproc, run
):
    """Megatron-Core's own store (its model's and ChainedOptimizer's sharded state dicts, no
    megart record, no random states) holds what megart saved: megart resumes it exactly."""
    _, trained = saved
    out, _ = megatron_core
    assert "megart" not in read_common(iteration_dir(out, 2))
    resumed = tw.holding(nproc, dict(run, load=str(out)))
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(curve, [resumed[0]], **SAME_RUN)


@pytest.mark.parametrize(
    "nproc,mistake,said",
    [(2, "local-experts", r"experts\.linear_fc1\.weight's chunks at \[0, 0, .* overlap"),
     (4, "no-expert-replicas",
      r"experts\.linear_fc1\.weight's chunks do not cover all of \[4, 4, 128, 32\]")],
)  # fmt: skip
def test_mistakes_in_the_expert_slices_are_caught(tmp_path, nproc, mistake, said):
    """Experts at their local numbers (rank 1's overwrite rank 0's place, the other half of
    the key empty), or experts written only by data-parallel rank 0 (at ep2 x dp4 the other
    expert-parallel rank's experts are missing): the store does not tile its keys, and the
    save refuses it."""
    import re

    import megatron_dist_ep_workers as w

    kw = dict(EP2, train_iters=2, save=str(tmp_path / "ckpt"))
    raised = launch(w.save_with_mistake, nproc, kw, mistake, timeout=300)
    assert re.search(said, raised[0]), raised
