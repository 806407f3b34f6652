"""megart plan under expert parallelism (--expert-model-parallel-size, plan.moe_memory,
plan.moe_time, plan.parameters, plan.data_parallel): against real megart train ranks at ep2 (and
ep2 x pp2, ep2 at dp4) with the routing prescribed (plan_moe_ep_workers), the parameter,
gradient and optimizer bytes exactly and the activations autograd saves at the peak exactly in
fp32, as a function of the token copies each rank's experts get (balanced: k T each; all on
rank 0's experts: ep k T and none); in bf16 within 1%, the experts' terms exact (the same
difference as at ep1: the dense layers' known CPU differences); with the distributed optimizer
(each bucket set sharded over its own group) every rank's state bytes exactly, 16-bit weights,
bf16 reduction and Megatron's bucket size included. The all-to-alls' buffers are
what the ranks post, forward, backward and replayed; their time, the experts' gradient
reduction and the search are checked by hand and by properties; the command line searches
expert parallelism where megart train runs it and refuses, in megart train's words, where it
does not."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plan_moe_ep_workers as pw
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.plan import load_profile
from megart.plan.collectives import collective_seconds
from megart.plan.data_parallel import data_parallel_bus_gb_per_s, data_parallel_seconds
from megart.plan.layout import Layout
from megart.plan.moe_time import expert_exchanges, expert_group_near, moe_mlp_shapes
from megart.plan.parameters import state_bytes
from megart.plan.timing import layer_work
from megart.training.config import TrainConfig
from plan_memory_check import SMALL, predicted_and_held
from test_plan_memory_moe import _replay_peak

MOE = dict(SMALL, num_experts=4, moe_ffn_hidden_size=48, disable_bias_linear=True,
           micro_batch_size=2)  # fmt: skip
EP2 = dict(MOE, expert_model_parallel_size=2)
# bf16: 160 tokens a microbatch, so that no saved tensor is shaped as a weight (SavedBytes).
BF16 = dict(MOE, bf16=True, micro_batch_size=5, global_batch_size=20)


def _first_rank_takes_all(held: dict) -> float:
    """Every token to experts 0..k-1, rank 0's at ep2: it gets ep k T copies, the other none."""
    return 2.0 if held["dp_rank"] % 2 == 0 else 0.0


# (name, processes, flags, routing)
CASES = [
    ("ep2 gelu top2 balanced", 2, EP2, "balanced"),
    ("ep2 gelu top2 all to rank 0", 2, EP2, "first"),
    (
        "ep2 swiglu aux z-loss fp64 router balanced",
        2,
        dict(EP2, swiglu=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
             moe_router_dtype="fp64"),
        "balanced",
    ),
    ("ep2 pp2 dense-moe pattern balanced", 4,
     dict(EP2, pipeline_model_parallel_size=2, moe_layer_freq="[1,0,1,1]"), "balanced"),
    ("ep2 dp4 top1 pre-softmax all to rank 0", 4,
     dict(EP2, moe_router_topk=1, moe_router_pre_softmax=True), "first"),
    ("ep2 full uniform 2 all to rank 0", 2,
     dict(EP2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
     "first"),
    # --moe-grouped-gemm: the local experts as one grouped product, the same saves.
    ("ep2 grouped gemm swiglu all to rank 0", 2, dict(EP2, swiglu=True, moe_grouped_gemm=True),
     "first"),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,kw,routing", CASES, ids=[c[0] for c in CASES])
def test_predicted_ep_bytes_are_what_a_rank_holds(name, nproc, kw, routing):
    share = (lambda held: 1.0) if routing == "balanced" else _first_rank_takes_all
    ranks = predicted_and_held(nproc, kw, pw.routed_held_bytes, (routing,), share)
    for held, want, cpu in ranks:
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])
        assert held["saved_peak"] == want["saved"] + cpu, (name, held, want)
        assert held["saved_after"] == 0
        if kw.get("recompute_method") == "uniform":
            assert held["recompute_peak"] == _replay_peak(kw, want), (name, held, want)
    if routing == "first":  # the routing, not the plan, decides which rank holds more
        peak = "recompute_peak" if kw.get("recompute_granularity") == "full" else "saved_peak"
        assert ranks[0][0][peak] > ranks[1][0][peak]


DISTOPT = dict(EP2, use_distributed_optimizer=True)
# (name, processes, flags, the saved bytes exact too: fp32 at sizes no weight shares)
DISTOPT_CASES = [
    ("ep2 dp2", 2, DISTOPT, True),
    ("ep2 dp4", 4, dict(DISTOPT, global_batch_size=16), True),
    ("ep2 dp4 bf16 half weights", 4,
     dict(DISTOPT, global_batch_size=16, bf16=True, half_weights=True, micro_batch_size=1), False),
    ("ep2 pp2 dp2 bf16 reduce ddp-bucket-size", 4,
     dict(DISTOPT, pipeline_model_parallel_size=2, bf16=True, grad_reduce_in_bf16=True,
          ddp_bucket_size=3000, micro_batch_size=1), False),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,kw,saved", DISTOPT_CASES, ids=[c[0] for c in DISTOPT_CASES])
def test_the_distributed_optimizer_shards_each_set_over_its_group(name, nproc, kw, saved):
    """The dense buckets over d, the experts' over their d / ep ranks (a rank's index there
    d // ep): each rank's moments, steps, main weights and padded buffers as it holds them."""
    for held, want, cpu in predicted_and_held(nproc, kw, pw.routed_held_bytes, ("balanced",)):
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])
        if saved:
            assert held["saved_peak"] == want["saved"] + cpu, (name, held, want)


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_under_bf16_the_expert_parallel_terms_are_exact(swiglu):
    """bf16 at ep2 within 1%, and off by exactly what the same model is off by at ep1 (the
    dense layers' known CPU differences, tests/test_plan_memory.py): the experts' and the
    exchanges' terms exact in 16 bits."""
    kw = dict(BF16, swiglu=swiglu)
    gaps = []
    for ep in (1, 2):
        args = (dict(kw, expert_model_parallel_size=ep), pw.routed_held_bytes, ("balanced",))
        for held, want, cpu in predicted_and_held(2, *args):
            for part in ("parameters", "gradients", "optimizer"):
                assert want[part] == held[part], (ep, held, part, want[part])
            assert held["saved_peak"] == pytest.approx(want["saved"] + cpu, rel=0.01)
            gaps.append((ep, held["saved_peak"] - want["saved"] - cpu))
    assert {gap for _, gap in gaps if _ == 1} == {gap for _, gap in gaps if _ == 2}, gaps


# (flags, the MoE layers' forward passes in a step: microbatches x MoE layers, replayed ones
# again)
EXCHANGE_CASES = {
    "fp32": (EP2, 2 * 4, 2 * 4),
    "bf16 fp32 router": (
        dict(BF16, expert_model_parallel_size=2, moe_router_dtype="fp32"),
        2 * 4,
        2 * 4,
    ),
    "full recomputation": (dict(EP2, recompute_granularity="full"), 2 * 4, 2 * 2 * 4),
}


@pytest.fixture(scope="module")
def posted() -> dict[str, list[list[int]]]:
    """Each case's send buffers on each of two ranks, balanced routing."""
    return {
        name: launch(pw.routed_exchanges, 2, kw, "balanced", timeout=300)
        for name, (kw, _, _) in EXCHANGE_CASES.items()
    }


@pytest.mark.parametrize("name", list(EXCHANGE_CASES))
def test_the_all_to_alls_are_what_ep2_ranks_post(name, posted):
    """expert_exchanges' buffers, once per MoE layer and microbatch forward (again where full
    recomputation replays it) and once backward: the balanced routing's exactly."""
    kw, backward, forward = EXCHANGE_CASES[name]
    c = TrainConfig(**kw)
    act = 2 if c.bf16 else 4
    fwd, bwd = expert_exchanges(c.gpt_config(), c.seq_length * c.micro_batch_size, act)
    want = Counter({n: 0 for n in fwd + bwd})
    for n in fwd:
        want[n] += forward
    for n in bwd:
        want[n] += backward
    for rank in posted[name]:
        assert Counter(rank) == want, (name, Counter(rank), want)


H100 = load_profile("h100-80gb")
MIXTRAL = GPTConfig(vocab_size=32000, seq_length=4096, hidden_size=4096, num_layers=32,
                    num_attention_heads=32, ffn_hidden_size=14336, activation="swiglu",
                    bias=False, num_experts=16, moe_aux_loss_coeff=0.01)  # fmt: skip


@pytest.mark.parametrize("ep,near", [(8, 8), (16, 8), (4, 4)])
def test_the_all_to_all_time_is_the_hand_computation(ep, near):
    """A Mixtral-sized layer, one microbatch of 4096 tokens, k = 2, bf16: forward four
    all-to-alls (the 16 counts, the 8192 copies of h, their weights, the outputs back) and
    backward three, each rank's buffer cut in ep pieces, near - 1 over NVLink and ep - near
    over its rail at once, one latency each; 16 ranks fill two 8-GPU nodes."""
    copies, h = 4096 * 2, 4096
    lat = H100.link_latency_us * 1e-6
    nv, rail = H100.nvlink_bus_gb_per_s * 1e9, H100.rail_gb_per_s * 1e9

    def a2a(nbytes: float) -> float:
        piece = nbytes / ep
        return max((near - 1) * piece / nv, (ep - near) * piece / rail) + lat

    tokens, weights = copies * h * 2, copies * 2
    forward = a2a(16 * 8) + a2a(tokens) + a2a(weights) + a2a(tokens)
    backward = a2a(tokens) + a2a(weights) + a2a(tokens)
    work = layer_work(MIXTRAL, 1, 1, False, None, H100, moe=True, ep=ep, ep_near=near)
    assert work.ep_comm == pytest.approx(forward + backward, rel=1e-12)
    assert layer_work(MIXTRAL, 1, 1, False, None, H100, moe=True).ep_comm == 0.0
    # Exposed: the exchanges add to the passes (the same layer with its group in one node
    # differs by the exchanges' difference alone).
    one_node = layer_work(MIXTRAL, 1, 1, False, None, H100, moe=True, ep=ep, ep_near=ep)
    assert work.forward + work.backward - one_node.forward - one_node.backward == pytest.approx(
        work.ep_comm - one_node.ep_comm, rel=1e-9, abs=1e-15
    )
    replayed = layer_work(MIXTRAL, 1, 1, False, "full", H100, moe=True, ep=ep, ep_near=near)
    assert replayed.ep_comm == pytest.approx(2 * forward + backward, rel=1e-12)


def test_an_iterations_ep_comm_is_every_moe_layers_exchanges():
    """estimate(): m microbatches through every MoE layer of the one stage, each its
    layer_work's all-to-alls (the group of 8 inside a node), and the experts' buckets
    (E/ep experts of each MoE layer, fp32) reduced apart."""
    from megart.plan.estimate import estimate

    base = TrainConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                       vocab_size=32000, global_batch_size=64, num_experts=8,
                       disable_bias_linear=True, moe_layer_freq="[1,0,1,0]", bf16=True)  # fmt: skip
    layout = Layout(1, 1, 16, 1, 2, False, None, False, ep=8)
    e = estimate(base, layout, H100)
    cfg = base.gpt_config()
    one = layer_work(cfg, 2, 1, False, None, H100, moe=True, ep=8, ep_near=8)
    assert e.time["ep_comm"] == pytest.approx(e.microbatches * 2 * one.ep_comm, rel=1e-12)
    expert = 2 * (8 // 8) * 2 * cfg.moe_ffn_size * 1024 * 4  # layers, experts, fc and proj
    assert e.memory["expert_gradient_buffers"] == expert
    assert e.time["ep_comm"] > 0 and e.layout.ep == 8


@pytest.mark.parametrize(
    "dp,pp,ep,near",
    [(16, 1, 8, 8), (16, 1, 16, 8), (12, 1, 3, 1), (6, 2, 3, 1), (6, 2, 2, 2), (4, 2, 4, 4)],
)
def test_expert_groups_are_placed_as_megarts_grid_places_them(dp, pp, ep, near):
    """ep consecutive ranks of a stage's dp (rank d + dp x stage at t = cp = 1): the fewest
    of its group any rank has in its 8-GPU node. 12 ranks in threes put 6, 7 | 8 apart; at
    dp 6, pp 2 stage 1 starts at rank 6, so 6, 7 | 8 again; a pair never straddles."""
    assert expert_group_near(8, dp, pp, ep) == near


@pytest.mark.parametrize("distributed", [False, True], ids=["all-reduce", "distributed"])
def test_the_experts_gradients_are_reduced_over_their_expert_data_parallel_group(distributed):
    """The dense gradients reduced over d, the experts' over d / ep ranks ep apart, one after
    the other (all-reduced; with the distributed optimizer reduce-scattered, and the 16-bit
    parameters all-gathered over the same groups); at ep = d the experts' need none."""
    layout = Layout(1, 1, 16, 1, 1, False, None, distributed, ep=4)
    grads, experts = 4e9, 3e9

    def seconds(lay: Layout, expert_bytes: float) -> tuple[float, float, float]:
        return data_parallel_seconds(MIXTRAL, lay, lay.dp, H100, grads, 0.0, True, False,
                                     4, None, expert_bytes)  # fmt: skip

    d_bus, e_bus = data_parallel_bus_gb_per_s(H100, 1, 16), data_parallel_bus_gb_per_s(H100, 4, 4)
    kind = "reduce_scatter" if distributed else "all_reduce"
    dense = collective_seconds(kind, grads - experts, 16, d_bus, H100)
    edp = collective_seconds(kind, experts, 4, e_bus, H100)
    exposed, gather, _ = seconds(layout, experts)
    assert exposed == pytest.approx(dense + edp, rel=1e-12)
    want = 0.0
    if distributed:  # 16-bit weights: half the fp32 gradients' bytes
        want = collective_seconds("all_gather", (grads - experts) / 2, 16, d_bus, H100)
        want += collective_seconds("all_gather", experts / 2, 4, e_bus, H100)
    assert gather == pytest.approx(want, rel=1e-12)
    whole = dataclasses.replace(layout, ep=16)
    assert seconds(whole, experts)[0] == pytest.approx(dense, rel=1e-12)
    assert seconds(whole, experts)[0] < exposed


SMALL_CFG = dict(vocab_size=256, seq_length=64, hidden_size=64, num_layers=4,
                 num_attention_heads=4, bias=False, moe_ffn_hidden_size=32)  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(
    experts=st.sampled_from([4, 8, 16]),
    k=st.integers(1, 2),
    swiglu=st.booleans(),
    freq=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
)
def test_more_expert_parallelism_never_holds_more_per_rank(experts, k, swiglu, freq, pp):
    """Over ep dividing the experts: the rank's parameter, gradient and optimizer bytes never
    grow with ep (E/ep experts each), the experts' gradients are what ep = 1 holds less the
    experts given away, and the experts' products keep their FLOPs (balanced: k T copies in
    all on each rank)."""
    cfg = GPTConfig(**SMALL_CFG, num_experts=experts, moe_router_topk=k,
                    moe_router_pre_softmax=k == 1, activation="swiglu" if swiglu else "gelu",
                    moe_layer_freq=freq)  # fmt: skip
    eps = [e for e in (1, 2, 4, 8, 16) if experts % e == 0]
    states = [state_bytes(cfg, 1, pp, 0, 1, 16, False, ep=e) for e in eps]
    for a, b in zip(states, states[1:], strict=False):
        assert b.parameters <= a.parameters and b.gradients <= a.gradients
        assert b.optimizer <= a.optimizer
    one = states[0]
    for e, s in zip(eps[1:], states[1:], strict=True):
        given_away = s.expert_gradients * (e - 1)  # the other ranks' experts
        assert s.gradients + given_away == one.gradients
    flops = [sum(2 * r * c * i * n for r, c, i, n in moe_mlp_shapes(cfg, 64, 1, e)) for e in eps]
    assert flops == pytest.approx([flops[0]] * len(eps), rel=1e-12)


@settings(max_examples=20, deadline=None)
@given(copies=st.floats(0.0, 4.0), more=st.floats(0.0, 4.0), ep=st.sampled_from([2, 4]))
def test_activations_grow_with_the_tokens_a_ranks_experts_get(copies, more, ep):
    """The saves are an increasing function of the copies a rank's experts get."""
    from megart.plan.activations import Precision
    from megart.plan.moe_memory import MoeRank, moe_layer_extra

    cfg = GPTConfig(**SMALL_CFG, num_experts=4)
    lo, hi = sorted((copies, more))

    def saved(share: float) -> float:
        return moe_layer_extra(cfg, 2, None, MoeRank(Precision(2, 2), ep=ep, expert_tokens=share))

    assert saved(lo) <= saved(hi)


ARGV = (
    "plan --gpu h100-80gb --num-gpus 16 --num-layers 4 --hidden-size 1024 "
    "--num-attention-heads 16 --seq-length 2048 --global-batch-size 64 "
    "--num-experts 8 --disable-bias-linear --json --top 400"
)


def _candidates(argv: str, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    assert megart_main(argv.split()) == 0
    return json.loads(capsys.readouterr().out)["candidates"]


def test_the_cli_searches_expert_parallelism_where_megart_train_runs_it(capsys):
    """Left out, ep is searched: each size dividing d x cp and the experts, beside tensor and
    context parallelism (tests/test_plan_moe_ep_tp.py), with and without the distributed
    optimizer; the JSON's layout and flags and the table name it, and its all-to-alls are
    timed."""
    found = _candidates(ARGV, capsys)
    layouts = [c["layout"] for c in found]
    spread = [lay for lay in layouts if lay["ep"] > 1]
    assert {lay["ep"] for lay in spread} >= {2, 4, 8}
    assert {lay["distributed_optimizer"] for lay in spread} == {False, True}
    for lay in spread:
        assert (lay["dp"] * lay["cp"]) % lay["ep"] == 0 and 8 % lay["ep"] == 0
        assert f"--expert-model-parallel-size {lay['ep']}" in lay["flags"]
    assert all(c["time_s"]["ep_comm"] > 0 for c in found if c["layout"]["ep"] > 1)
    assert all(c["time_s"]["ep_comm"] == 0 for c in found if c["layout"]["ep"] == 1)
    table = ARGV.replace(" --json", "").replace("--top 400", "--top 60")
    assert megart_main(table.split()) == 0
    assert " e2 " in capsys.readouterr().out


def test_the_cli_keeps_a_given_expert_parallel_size(capsys):
    found = _candidates(f"{ARGV} --expert-model-parallel-size 4", capsys)
    assert found and all(c["layout"]["ep"] == 4 for c in found)
    assert any(c["layout"]["tp"] > 1 for c in found)
    one = f"{ARGV} --expert-model-parallel-size 4 --pipeline-model-parallel-size 1"
    both = _candidates(f"{one} --micro-batch-size 1", capsys)
    plain = [c for c in both if not c["layout"]["distributed_optimizer"]]
    sharded = [c for c in both if c["layout"]["distributed_optimizer"]]
    assert plain and sharded
    # Every rank's state sharded: the dense over d = 16, the experts' over d / ep = 4.
    assert sharded[0]["memory_gib"]["optimizer"] < plain[0]["memory_gib"]["optimizer"] / 4


@pytest.mark.parametrize(
    "extra,says",
    [
        ("--expert-model-parallel-size 3", "--expert-model-parallel-size 3: it must divide"),
        ("--expert-model-parallel-size 16", "must divide --num-experts 8"),
    ],
    ids=["not-dividing-d", "not-dividing-experts"],
)  # fmt: skip
def test_the_cli_refuses_what_megart_train_cannot_run(extra, says, capsys):
    assert megart_main(f"{ARGV} {extra}".split()) == 2
    assert says in capsys.readouterr().err
