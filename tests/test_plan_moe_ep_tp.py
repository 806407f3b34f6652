"""megart plan under expert parallelism beside tensor (with sequence parallelism) and context
parallelism (plan.moe_memory, plan.moe_time, plan.parameters, plan.candidates): against real
megart train ranks at ep2 x tp2, ep2 x cp2 and ep2 x tp2 x cp2 with the routing prescribed
(plan_moe_ep_workers), the parameter, gradient and optimizer bytes exactly (each expert f/t
wide, E/ep on a rank; the experts' buckets sharded over dp x cp / ep ranks by the distributed
optimizer) and the activations autograd saves at the peak exactly in fp32 (the tp-gathered
tokens exchanged: each tensor-parallel rank's experts get k T copies of the whole sequence's
T); the exchange's group placement by hand; the command line searches expert parallelism at
t > 1 and cp > 1."""

from __future__ import annotations

from collections import Counter

import pytest

import plan_moe_ep_workers as pw
from megart.launcher import launch
from megart.plan.moe_time import expert_exchanges, expert_group_near
from megart.training.config import TrainConfig
from test_plan_moe_ep import ARGV, _candidates
from test_plan_moe_shared import EP2, _modules, check_ranks

TP2 = dict(EP2, tensor_model_parallel_size=2, sequence_parallel=True)
CP2 = dict(EP2, context_parallel_size=2)

# (name, processes, flags, routing, exact)
CASES = [
    ("ep2 tp2 dp2 balanced", 4, TP2, "balanced", True),
    ("ep2 tp2 dp2 swiglu moe all to rank 0", 4, dict(TP2, swiglu=True, **_modules("moe")),
     "first", True),
    ("ep2 tp2 dp2 distributed optimizer balanced", 4,
     dict(TP2, use_distributed_optimizer=True), "balanced", True),
    ("ep2 cp2 balanced", 2, CP2, "balanced", True),
    # Context parallelism without expert parallelism: MoE layers over s/cp tokens a rank.
    ("cp2 aux z-loss", 2, dict(EP2, expert_model_parallel_size=1, context_parallel_size=2,
                               moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001), None, True),
    ("cp2 tp2 moe", 4, dict(TP2, expert_model_parallel_size=1, context_parallel_size=2,
                            **_modules("moe")), None, True),
    ("ep2 cp2 dp2 distributed optimizer gated", 4,
     dict(CP2, use_distributed_optimizer=True, moe_shared_expert_gate=True), "balanced", True),
    ("ep2 tp2 cp2 balanced", 4, dict(TP2, context_parallel_size=2), "balanced", True),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,kw,routing,exact", CASES, ids=[c[0] for c in CASES])
def test_predicted_ep_tp_cp_bytes_are_what_a_rank_holds(name, nproc, kw, routing, exact):
    check_ranks(name, nproc, kw, routing, exact)


def test_the_exchanges_are_the_tp_gathered_tokens_each_tp_rank_posts():
    """ep2 x tp2 (dp2): each of the four ranks posts expert_exchanges' buffers for the whole
    microbatch's s b tokens (gathered over tp before the exchange: t times Megatron-Core's
    all-to-all dispatcher's), once per MoE layer and microbatch each way, balanced routing."""
    kw = dict(TP2, moe_shared_expert_intermediate_size=None)
    c = TrainConfig(**kw)
    fwd, bwd = expert_exchanges(c.gpt_config(), c.seq_length * c.micro_batch_size, 4)
    passes = 2 * 4  # microbatches x MoE layers
    want = Counter({n: 0 for n in fwd + bwd})
    for n in fwd + bwd:
        want[n] += passes
    ranks = launch(pw.routed_exchanges, 4, kw, "balanced", timeout=300)
    assert len(ranks) == 4
    for rank in ranks:
        assert Counter(rank) == want, (Counter(rank), want)


@pytest.mark.parametrize(
    "gpus,dp,pp,ep,tp,cp,near",
    [
        (8, 2, 1, 4, 2, 2, 4),  # d = 0..3 at global ranks 0, 2, 4, 6: one node
        (8, 1, 1, 4, 4, 4, 2),  # ranks 0, 4, 8, 12: two nodes, two each
        (8, 4, 2, 8, 2, 1, 4),  # each stage's 8 ranks 0, 2, .., 14: two nodes of four
        (8, 2, 1, 2, 8, 1, 1),  # t = 8: each rank a node of its own group's
        (8, 16, 1, 8, 1, 1, 8),  # t = cp = 1: ep consecutive ranks, as before
    ],
)
def test_the_group_placement_is_the_rank_order_of_parallel_experts(gpus, dp, pp, ep, tp, cp, near):
    """An expert-model-parallel group: the ep ranks of one tensor-parallel rank at consecutive
    places of the dp x cp group (cp innermost), global ranks t apart (parallel.experts)."""
    from megart.parallel.experts import expert_groups
    from megart.parallel.layout import make_layout

    assert expert_group_near(gpus, dp, pp, ep, tp, cp) == near
    world = tp * cp * dp * pp
    layout = make_layout(world, tp, pp, dp, cp=cp)
    fewest = min(
        min(sum(r // gpus == node for r in group) for node in {r // gpus for r in group})
        for group in expert_groups(layout, ep)[0]
    )
    assert fewest == near


def test_the_cli_searches_expert_parallelism_beside_tensor_and_context_parallelism(capsys):
    """Left out, ep is searched at t > 1 (with sequence parallelism) and at cp > 1 too, each
    dividing d x cp and the experts; its all-to-alls are timed, and at t > 1 they are longer
    than at t = 1 for the same ep and d x cp (each tensor-parallel rank sends the gathered
    tokens)."""
    found = _candidates(f"{ARGV} --pipeline-model-parallel-size 1 --micro-batch-size 1", capsys)
    spread = [c for c in found if c["layout"]["ep"] > 1]
    assert any(c["layout"]["tp"] > 1 for c in spread)
    assert any(c["layout"]["cp"] > 1 for c in spread)
    for c in spread:
        lay = c["layout"]
        assert (lay["dp"] * lay["cp"]) % lay["ep"] == 0 and 8 % lay["ep"] == 0
        assert lay["tp"] == 1 or lay["sequence_parallel"]
        assert c["time_s"]["ep_comm"] > 0
