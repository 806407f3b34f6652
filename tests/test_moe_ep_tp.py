"""Expert parallelism with tensor (and sequence) parallelism and with context parallelism, as
Megatron-Core 0.16 with --expert-tensor-parallel-size left at the tensor-parallel size: the
expert groups are Megatron-Core's own RankGenerator's (an expert-parallel group of the same
tensor-parallel rank, spanning context-parallel ranks where cp > 1); runs of ep2 x tp2, ep2 x
cp2 (each with and without the distributed optimizer), ep4 over cp2 x dp2, ep2 x tp2 x pp2,
ep2 x tp2 x cp2, --recompute-modules moe and shared experts at ep2 x tp2 follow the
one-process loss curve, its gradient norm and its logged load-balancing and z-losses; the curve
catches the experts' outputs not summed over the tensor-parallel group, their gradients scaled
by edp / dp instead of edp / (dp x cp), and a norm counting their tensor-parallel shards on one
rank only; checkpoints resume on the curve at the same layout and are refused by name at
another tensor-parallel size. Against Megatron-Core's own tp2 x EP2 model on 4 processes, with
its allgather and its alltoall token dispatchers: the same logits and one step's gradients."""

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
TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
CP2 = dict(context_parallel_size=2)
ZERO = dict(use_distributed_optimizer=True)
SHARED = dict(moe_shared_expert_intermediate_size=48)
RECOMPUTE_MOE = dict(recompute_granularity="selective", recompute_modules=["moe"])
# name: (processes, flags, train_mistaken's mistake or None, the rank whose history to read)
RUNS = {
    "ep2-tp2": (4, dict(EP2, **TP2), None, 0),
    "ep2-tp2-distopt": (4, dict(EP2, **TP2, **ZERO), None, 0),
    "ep2-cp2": (4, dict(EP2, **CP2), None, 0),
    "ep2-cp2-distopt": (4, dict(EP2, **CP2, **ZERO), None, 0),
    "ep4-cp2-dp2": (4, dict(EP2, **CP2, expert_model_parallel_size=4), None, 0),
    "ep2-tp2-pp2-distopt": (8, dict(EP2, **TP2, **ZERO, pipeline_model_parallel_size=2), None, -1),
    "ep2-tp2-cp2": (8, dict(EP2, **TP2, **CP2), None, 0),
    "ep2-tp2-recompute-moe": (4, dict(EP2, **TP2, **RECOMPUTE_MOE), None, 0),
    # The mistakes the curve exists to catch.
    "ep2-tp2-experts-output-sliced": (4, dict(EP2, **TP2), "experts-output-sliced", 0),
    "ep2-cp2-experts-scaled-over-dp": (4, dict(EP2, **CP2), "experts-scaled-over-dp", 0),
    "ep2-cp2-distopt-scaled-over-dp": (4, dict(EP2, **CP2, **ZERO), "experts-scaled-over-dp", 0),
    "ep2-tp2-experts-norm-tp-rank-0": (4, dict(EP2, **TP2), "experts-norm-tp-rank-0", 0),
    "ep2-tp2-distopt-norm-tp-rank-0": (4, dict(EP2, **TP2, **ZERO), "experts-norm-tp-rank-0", 0),
}


# (tp, cp, pp, dp, ep): tensor-parallel shards of an expert, groups spanning context-parallel
# ranks, both, stages, and an expert-data-parallel group of one.
LAYOUTS = [(2, 1, 1, 2, 2), (2, 1, 2, 2, 2), (4, 1, 1, 2, 2), (1, 2, 1, 2, 2), (1, 2, 1, 2, 4),
           (1, 2, 2, 1, 2), (2, 2, 1, 2, 2), (2, 2, 2, 2, 4), (2, 2, 1, 2, 4), (1, 4, 1, 2, 8),
           (2, 1, 1, 4, 2), (1, 1, 2, 4, 2)]  # fmt: skip


@pytest.mark.parametrize("tp,cp,pp,dp,ep", LAYOUTS)
def test_the_expert_groups_are_megatron_cores(tp, cp, pp, dp, ep):
    """megart's groups and ranks are those of Megatron-Core's expert RankGenerator
    (initialize_model_parallel's: tp-ep-dp-pp over the expert ranks, its order's cp dropped,
    the expert tensor-parallel size the tensor-parallel size)."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    world = tp * cp * pp * dp
    generator = parallel_state.RankGenerator(
        tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp",
        rank_offset=0,
    )  # fmt: skip
    layout = make_layout(world, tp=tp, pp=pp, cp=cp)
    model, data = expert_groups(layout, ep)
    want_model, want_data = generator.get_ranks("ep"), generator.get_ranks("dp")
    assert model == sorted(tuple(g) for g in want_model)
    assert data == sorted(tuple(g) for g in want_data)
    for rank in range(world):
        ep_rank = next(g.index(rank) for g in want_model if rank in g)
        edp_rank = next(g.index(rank) for g in want_data if rank in g)
        assert expert_ranks(layout, ep, rank) == (ep_rank, edp_rank)


def test_the_expert_groups_by_hand():
    """tp2 x cp2 x dp2 (rank = tp + 2 (cp + 2 dp)), ep2: each expert-parallel group is one
    tensor-parallel rank's two context-parallel ranks of one data-parallel rank; ep4: its
    four data- and context-parallel ranks."""
    layout = make_layout(8, tp=2, cp=2)
    assert expert_groups(layout, 2) == (
        [(0, 2), (1, 3), (4, 6), (5, 7)],
        [(0, 4), (1, 5), (2, 6), (3, 7)],
    )
    assert expert_groups(layout, 4) == (
        [(0, 2, 4, 6), (1, 3, 5, 7)],
        [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
    )
    assert [expert_ranks(layout, 2, r) for r in range(8)] == [
        (0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "world,kw,ep,message",
    [
        (8, dict(tp=2, cp=2), 8, "must divide data-parallel size 2 x context-parallel size 2 = 4"),
    ],
)
def test_the_grid_refuses_what_does_not_split_the_data_and_context_ranks(world, kw, ep, message):
    with pytest.raises(ConfigError, match=f"--expert-model-parallel-size {ep}: it {message}"):
        check_expert_parallel(make_layout(world, **kw), ep, 8)


@pytest.mark.parametrize("world,flags", [(4, TP2), (4, CP2), (8, dict(TP2, **CP2))])
def test_megart_train_takes_tensor_and_context_parallelism(world, flags):
    tw.tiny(**dict(EP2, **flags)).check(world)


@pytest.fixture(scope="module")
def runs():
    """Each of RUNS' history (by name); conftest.moe_one_process is the one-process run's."""
    return ew.launched(RUNS)


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r[2] is None])
def test_expert_parallel_runs_follow_the_one_process_curve(moe_one_process, runs, name):
    """The loss, the clipped gradient's norm and the logged auxiliary losses of one process."""
    ew.assert_on_curve(moe_one_process, runs[name])


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if r[2] is not None])
def test_the_curve_catches_wrong_experts_under_tp_and_cp(moe_one_process, runs, name):
    """Measured: the gradient norm off by 1.6e-3 to 1.1e-1 of itself from the first step, the
    loss by 1.6e-5 to 2.8e-3 from the second or third on."""
    ew.assert_off_curve(moe_one_process, runs[name])


def test_shared_experts_follow_their_curve_at_ep2_tp2():
    """Shared experts, split over the tensor-parallel group as the dense MLP is, beside the
    routed experts spread over expert parallelism and split over tensor parallelism."""
    one = launch(tw.train_kw, 1, dict(TRAIN, **SHARED), timeout=300)[0]
    run = launch(tw.train_kw, 4, dict(EP2, **TP2, **SHARED), timeout=300)[0]
    ew.assert_on_curve(one, run)


def test_an_ep2_tp2_checkpoint_resumes_on_the_curve_at_its_layout(tmp_path, runs):
    """Each (tensor-parallel, expert-parallel) rank writes its file (mp_rank_TT_EEE); the
    resumed ranks hold what the saving ranks held and go on on the curve; so do runs at
    another tensor-parallel size (ep2 x dp4 with the distributed optimizer, and one process),
    which reshard it (training.expert_shards merges each tensor-parallel rank's files)."""
    layout = dict(EP2, **TP2, **ZERO)
    store = tmp_path / "ckpt"
    trained, resumed = tw.saved_and_resumed(4, layout, 4, layout, store)
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(runs["ep2-tp2-distopt"], resumed, **SAME_RUN)
    saved = sorted(p.parent.name for p in (store / "iter_0000002").glob("*/*.pt"))
    assert saved == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    at_tp1 = tw.holding(4, dict(EP2, **ZERO, load=str(store)))
    at_one = tw.holding(1, dict(TRAIN, load=str(store)))
    for run in (at_tp1, at_one):
        tw.assert_holds(trained, run)
        tw.assert_resumed_on_curve(runs["ep2-tp2-distopt"], run, **SAME_RUN)


def test_an_ep2_cp2_checkpoint_resumes_on_the_curve(tmp_path, runs):
    """The second expert-parallel rank's file is written by a context-parallel rank 1 (rank 0
    of its expert-data-parallel group); the checkpoint resumes at cp2 and, the files being the
    same, at cp1 (ep2 over dp2)."""
    layout = dict(EP2, **CP2)
    store = tmp_path / "ckpt"
    trained, resumed = tw.saved_and_resumed(4, layout, 4, layout, store)
    saved = sorted(p.parent.name for p in (store / "iter_0000002").glob("*/*.pt"))
    assert saved == ["mp_rank_00_000", "mp_rank_00_001"]
    at_cp1 = tw.holding(2, dict(EP2, load=str(store)))
    for run in (resumed, at_cp1):
        tw.assert_holds(trained, run)
        tw.assert_resumed_on_curve(runs["ep2-cp2"], run, **SAME_RUN)


# 16 experts, each token to one: some get no token in an iteration, so the zero count depends
# on the experts' gradients; the vocabulary of 200 pads to 256 rows at tp 1 and 2 alike.
STATS = dict(num_experts=16, moe_router_topk=1, moe_router_pre_softmax=True,
             disable_bias_linear=True, vocab_size=200, mock_data=True, train_iters=3,
             log_params_norm=True, log_num_zeros_in_grad=True)  # fmt: skip


def test_the_logged_norm_and_zeros_count_each_expert_shard_once():
    """--log-params-norm and --log-num-zeros-in-grad at ep2 x tp2 (with and without the
    distributed optimizer) and ep2 x cp2: the one-process figures (the zero count exactly)."""
    one = launch(tw.train_kw, 1, STATS, timeout=300)[0]
    ep2 = dict(STATS, expert_model_parallel_size=2)
    for flags in (TP2, dict(TP2, **ZERO), dict(CP2, **ZERO)):
        run = launch(tw.train_kw, 4, dict(ep2, **flags), timeout=300)[0]
        assert [h["num_zeros_in_grad"] for h in run] == [h["num_zeros_in_grad"] for h in one]
        for key in ("params_norm", "loss"):
            assert [h[key] for h in run] == pytest.approx([h[key] for h in one], **SAME_RUN)


# Against Megatron-Core's own model at tp2 x EP2 (tests/moe_ep_tp_workers.py): (model, loss
# factor, its token dispatcher, megart's deliberate mistake or None).
BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            bias=False, num_experts=4, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)  # fmt: skip
MEGATRON_CASES = {
    "allgather": (BASE, 0.5, "allgather", None),
    "alltoall": (BASE, 0.5, "alltoall", None),
    "alltoall-swiglu-shared-experts": (
        dict(BASE, activation="swiglu", moe_shared_expert_intermediate_size=24), 0.5, "alltoall",
        None),
    "alltoall-sigmoid-top3-of-8": (
        dict(BASE, num_experts=8, moe_router_topk=3, moe_router_score_function="sigmoid"), 0.25,
        "alltoall", None),
    # The mistake this exists to catch.
    "alltoall-experts-output-sliced": (BASE, 0.5, "alltoall", "experts-output-sliced"),
}  # fmt: skip


@pytest.fixture(scope="module")
def megatron():
    """Each case's results on each of the 4 ranks (tp rank innermost: rank = tp + 2 dp)."""
    pytest.importorskip("megatron.core")
    import moe_ep_tp_workers as mew

    ranks = launch(mew.compare_all, 4, list(MEGATRON_CASES.values()), timeout=300)
    return {name: [r[i] for r in ranks] for i, name in enumerate(MEGATRON_CASES)}


@pytest.mark.parametrize("name", [n for n, c in MEGATRON_CASES.items() if c[3] is None])
def test_ep2_tp2_experts_are_megatron_cores(megatron, name):
    """megart's and Megatron-Core's tp2 x EP2 models holding the same pieces of one set of
    weights, each data-parallel rank on its own tokens: the same logits (and megart's one
    process's on those tokens), and one training step's gradients before any data-parallel
    average, every expert's (each summing both data-parallel ranks' tokens) included."""
    ranks = megatron[name]
    experts = MEGATRON_CASES[name][0]["num_experts"]
    assert sorted({e for r in ranks for e in r["held"]}) == list(range(experts))
    assert [r["held"] for r in ranks[:2]] == [list(range(experts // 2))] * 2  # tp rank 0, 1
    for r in ranks:
        assert r["scale"] > 0.5 and r["top"] > 1e-3
        assert r["megatron_logits"] < 1e-6  # its softmax over experts rounds to fp32
        assert r["one_process_logits"] < 1e-12
        assert r["largest"] < 1e-6 and r["experts"] < 1e-6


def test_the_megatron_comparison_catches_outputs_not_summed_over_tp(megatron):
    for r in megatron["alltoall-experts-output-sliced"]:
        assert r["megatron_logits"] > 1e-2 and r["largest"] > 1e-2
