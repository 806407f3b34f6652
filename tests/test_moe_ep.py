"""Expert parallelism (--expert-model-parallel-size, models.expert_exchange, training.
expert_grads): each rank of an expert-model-parallel group holds 1/ep of every MoE layer's
experts, drawn as one process draws them; its tokens travel to their experts' owners and
back. Runs of ep2 (dp2), ep2 x pp2 (1F1B and interleaved), ep2 and ep4 at dp4, ep2 with full
recomputation (the exchanges replayed) follow the one-process loss curve, its
gradient norm and its logged load-balancing and z-losses, with both auxiliary losses on; the
curve catches the experts' gradients unscaled and a norm counting each rank's experts only; a
checkpoint resumes on the curve at the same layout, every expert-parallel rank writing its own
file (at another layout: tests/test_moe_ep_reshard.py); what this slice cannot run is refused
by name."""

import pytest

import moe_ep_workers as ew
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.parallel import make_layout
from megart.parallel.experts import check_expert_parallel, expert_groups, expert_ranks
from moe_ep_workers import TRAIN
from train_workers import SAME_RUN

EP2 = dict(TRAIN, expert_model_parallel_size=2)
EP4 = dict(TRAIN, expert_model_parallel_size=4)
PP2 = dict(pipeline_model_parallel_size=2)
TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
CP2 = dict(context_parallel_size=2)
# name: (processes, flags, train_mistaken's mistake or None, the rank whose history to read)
RUNS = {
    "ep2": (2, EP2, None, 0),
    "ep2-pp2": (4, dict(EP2, **PP2), None, -1),
    "ep2-dp4": (4, EP2, None, 0),
    "ep4-dp4": (4, EP4, None, 0),
    "ep2-pp2-interleaved": (4, dict(EP2, **PP2, num_layers_per_virtual_pipeline_stage=1), None, -1),
    "ep2-recompute-full": (2, dict(EP2, recompute_granularity="full"), None, 0),
    # The mistakes the curve exists to catch.
    "ep2-experts-unscaled": (2, EP2, "experts-unscaled", 0),
    "ep2-dp4-experts-unscaled": (4, EP2, "experts-unscaled", 0),
    "ep2-experts-norm-local": (2, EP2, "experts-norm-local", 0),
}


def test_the_expert_groups_are_megatrons():
    """Megatron-Core's parallel_state at tp = cp = 1: ep consecutive data-parallel ranks, and
    the data-parallel ranks of one expert-parallel index; per pipeline stage."""
    layout = make_layout(8, pp=2)  # dp 4: ranks 0-3 stage 0, 4-7 stage 1
    model, data = expert_groups(layout, 2)
    assert model == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert data == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert [expert_ranks(layout, 2, r) for r in (0, 1, 2, 3, 5)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (1, 0),
    ]  # fmt: skip
    assert expert_groups(layout, 4) == ([(0, 1, 2, 3), (4, 5, 6, 7)], [(0,), (1,), (2,), (3,),
                                        (4,), (5,), (6,), (7,)])  # fmt: skip


@pytest.mark.parametrize(
    "world,kw,ep,experts,message",
    [
        (4, {}, 3, 6, "must divide the data-parallel size 4"),
        (4, {}, 4, 6, "must divide --num-experts 6"),
        (4, dict(tp=2), 4, 4, "must divide the data-parallel size 2 "),
        (6, dict(cp=2), 4, 4, "must divide data-parallel size 3 x context-parallel size 2 = 6"),
        (2, {}, 2, None, "needs --num-experts"),
    ],
)
def test_the_grid_refuses_what_does_not_split(world, kw, ep, experts, message):
    with pytest.raises(ConfigError, match=f"--expert-model-parallel-size {ep}.*{message}"):
        check_expert_parallel(make_layout(world, **kw), ep, experts)


@pytest.mark.parametrize(
    "world,flags,message",
    [
        (4, dict(expert_model_parallel_size=3), "must divide the data-parallel size 4"),
        (4, dict(TP2, expert_model_parallel_size=4), "must divide the data-parallel size 2 "),
        (6, dict(CP2, expert_model_parallel_size=4, global_batch_size=12), "size 2 = 6"),
    ],
)
def test_megart_train_refuses_what_this_slice_cannot_run(world, flags, message):
    config = tw.tiny(**dict(EP2, **flags))
    with pytest.raises(ConfigError, match=f"--expert-model-parallel-size .*{message}"):
        config.check(world)


def test_each_rank_draws_the_one_process_experts_of_its_global_indices():
    one = launch(tw.initial_weights, 1, TRAIN, timeout=300)[0]
    ranks = launch(tw.initial_weights, 2, EP2, timeout=300)
    held = [{n for n in r if ".experts." in n} for r in ranks]
    assert held[0] == {n for n in one if ".experts.0." in n or ".experts.1." in n}
    assert held[1] == {n for n in one if ".experts.2." in n or ".experts.3." in n}
    merged = tw.merged_by_place(
        [{"w": r} for r in ranks], "w"
    )  # the dense weights equal on both ranks
    assert set(merged) == set(one)
    assert all((merged[n] == one[n]).all() for n in one)


@pytest.fixture(scope="module")
def runs():
    return ew.launched(RUNS)


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r[2] is None])
def test_expert_parallel_runs_follow_the_one_process_curve(moe_one_process, runs, name):
    """The loss, the clipped gradient's norm (the tiny runs clip at 1.0, below the norm of
    every iteration here) and the logged auxiliary losses of the one-process run."""
    ew.assert_on_curve(moe_one_process, runs[name])


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r[2] is not None])
def test_the_curve_catches_wrong_expert_gradients(moe_one_process, runs, name):
    """Measured: the gradient norm off by 2e-2 (local norm) to 1e-1 (unscaled) of itself
    from the first step, the loss by 1.6e-5 to 2.8e-5 from the second on."""
    ew.assert_off_curve(moe_one_process, runs[name])


def test_a_checkpoint_resumes_on_the_curve_at_the_same_layout(tmp_path, runs):
    """Every expert-parallel rank writes its file (Megatron's _EEE suffix), the resumed ranks
    hold what the saving ranks held, and the run goes on on the curve."""
    layout = dict(EP2, **PP2)
    store = tmp_path / "ckpt"
    trained, resumed = tw.saved_and_resumed(4, layout, 4, layout, store)
    tw.assert_holds(trained, resumed)
    straight = [{"loss": h["loss"]} for h in runs["ep2-pp2"]]
    tw.assert_resumed_on_curve(straight, [resumed[-1]], **SAME_RUN)
    saved = sorted(p.parent.name for p in (store / "iter_0000002").glob("*/*.pt"))
    assert saved == ["mp_rank_00_000_000", "mp_rank_00_000_001",
                     "mp_rank_00_001_000", "mp_rank_00_001_001"]  # fmt: skip
