"""megart plan with the shared experts' gate (--moe-shared-expert-gate: sigmoid(x . w), w a
[1, h] weight, scaling the shared experts' output; plan.parameters, plan.moe_memory,
plan.moe_time): against real megart train ranks at tp1, tp2 with sequence parallelism and ep2
(the routing prescribed), the parameter, gradient and optimizer bytes exactly (the gate's
weight in the dense buckets, after the shared experts'), the activations autograd saves at the
peak and the most held while a checkpoint (moe, shared_experts) replays, exactly in fp32 and at
tp2 in bf16, within 1% at tp1 in bf16 (tests/test_plan_moe_shared.py's check); its product is
torch's FLOP count of a real tp2 layer (tests/test_plan_moe_time.py's cases); and properties
over small models."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.models.config import GPTConfig
from megart.plan.activations import Precision, layer_bytes
from megart.plan.moe_memory import MoeRank, moe_layer_extra, moe_replay_bytes
from megart.plan.moe_time import moe_mlp_shapes, shared_elementwise
from megart.plan.parameters import state_bytes
from test_plan_moe_shared import BF16, EP2, SHARED, SMALL_CFG, TP2, _modules, check_ranks

GATED = dict(SHARED, moe_shared_expert_gate=True)

# (name, processes, flags, routing: None (the router's own) or plan_moe_ep_workers', exact)
CASES = [
    ("tp1 gelu", 1, GATED, None, True),
    ("tp1 swiglu shared_experts", 1, dict(GATED, swiglu=True, **_modules("shared_experts")),
     None, True),
    ("tp1 aux moe", 1, dict(GATED, moe_aux_loss_coeff=0.01, **_modules("moe")), None, True),
    # The router casts its input: the gate's product keeps the input itself at t = 1 with the
    # shared experts' (one storage), at t = 2 alone (theirs is the gathered sequence).
    ("tp1 fp64 router", 1, dict(GATED, moe_router_dtype="fp64"), None, True),
    ("tp1 fp64 router shared_experts", 1,
     dict(GATED, moe_router_dtype="fp64", **_modules("shared_experts")), None, True),
    ("tp1 fp64 router moe", 1, dict(GATED, moe_router_dtype="fp64", **_modules("moe")), None,
     True),
    ("tp2 sp gelu", 2, dict(TP2, moe_shared_expert_gate=True), None, True),
    ("tp2 sp fp64 router", 2, dict(TP2, moe_shared_expert_gate=True, moe_router_dtype="fp64"),
     None, True),
    ("tp2 sp fp64 router moe", 2, dict(TP2, moe_shared_expert_gate=True,
                                       moe_router_dtype="fp64", **_modules("moe")), None, True),
    ("tp2 sp swiglu shared_experts", 2,
     dict(TP2, moe_shared_expert_gate=True, swiglu=True, **_modules("shared_experts")), None,
     True),
    ("tp2 sp bf16 moe", 2, dict(TP2, moe_shared_expert_gate=True, bf16=True, micro_batch_size=4,
                                **_modules("moe")), None, True),
    ("ep2 balanced", 2, dict(EP2, moe_shared_expert_gate=True), "balanced", True),
    ("ep2 dp4 distributed optimizer all to rank 0", 4,
     dict(EP2, moe_shared_expert_gate=True, use_distributed_optimizer=True,
          global_batch_size=16), "first", True),
    ("tp1 bf16", 1, dict(BF16, moe_shared_expert_gate=True), None, False),
    ("tp1 bf16 fp32 router shared_experts", 1,
     dict(BF16, moe_shared_expert_gate=True, moe_router_dtype="fp32",
          **_modules("shared_experts")), None, False),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,kw,routing,exact", CASES, ids=[c[0] for c in CASES])
def test_predicted_gate_bytes_are_what_a_rank_holds(name, nproc, kw, routing, exact):
    check_ranks(name, nproc, kw, routing, exact)


@settings(max_examples=30, deadline=None)
@given(
    swiglu=st.booleans(),
    width=st.sampled_from([16, 48]),
    tp=st.sampled_from([1, 2]),
    bf16=st.booleans(),
    router=st.sampled_from([None, "fp32", "fp64"]),
    modules=st.sampled_from([(), ("moe",), ("shared_experts",), ("moe", "shared_experts")]),
)
def test_the_gate_adds_parameters_saves_and_work(swiglu, width, tp, bf16, router, modules):
    """The gate adds h parameters (dense: no expert gradients), at least its sigmoid and the
    shared output (h + 1 per token of the slice) to the saves unless a checkpoint drops them,
    and then exactly as much to that checkpoint's replay; an h-long product per token and
    element-wise work."""
    base = GPTConfig(**SMALL_CFG, num_experts=4, activation="swiglu" if swiglu else "gelu",
                     moe_shared_expert_intermediate_size=width, moe_router_dtype=router,
                     recompute_granularity="selective" if modules else None,
                     recompute_modules=modules or ("core_attn",))  # fmt: skip
    gated = dataclasses.replace(base, moe_shared_expert_gate=True)
    for ep in (1, 2):
        plain = state_bytes(base, tp, 1, 0, 1, 2, False, ep=ep)
        more = state_bytes(gated, tp, 1, 0, 1, 2, False, ep=ep)
        assert more.parameters - plain.parameters == 4 * 64 * 4  # 4 layers: h fp32 each
        assert more.expert_gradients == plain.expert_gradients
    prec, sp = Precision(2, 2) if bf16 else Precision(4, 4), tp > 1
    rank = MoeRank(prec, tp=tp, sp=sp)
    rec = base.recompute_granularity

    def kept(cfg: GPTConfig) -> float:
        return layer_bytes(cfg, 2, tp, sp, rec, prec) + moe_layer_extra(cfg, 2, rec, rank)

    tokens = SMALL_CFG["seq_length"] * 2 / tp
    gate = (64 + 1) * prec.other * tokens
    more, rise = kept(gated) - kept(base), moe_replay_bytes(gated, 2, rank)
    if modules:  # dropped by the checkpoint, made again by its replay
        assert more == 0
        assert rise - moe_replay_bytes(base, 2, rank) >= gate
    else:
        assert more >= gate and rise == 0
    shapes = moe_mlp_shapes(gated, 64, tp)
    assert shapes[:-1] == moe_mlp_shapes(base, 64, tp) and shapes[-1] == (64 / tp, 1, 64, 1)
    assert shared_elementwise(gated, tp) > shared_elementwise(base, tp)
