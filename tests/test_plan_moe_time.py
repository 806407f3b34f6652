"""megart plan's time of a mixture-of-experts layer split over tensor-parallel ranks
(plan.moe_time, timing.layer_work): the dispatcher's collectives, kind and bytes, are those a
real layer runs on two ranks with sequence parallelism, forward and backward, and its products'
FLOPs are torch's count of that layer's forward, whatever the routing (shared experts
included); layer_work adds those
collectives to the attention's, exposed, in place of a dense MLP's."""

from __future__ import annotations

from collections import Counter

import pytest

import plan_moe_workers as pmw
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.plan import load_profile
from megart.plan.collectives import KEPT_INPUT_OVERLAP, collective_seconds
from megart.plan.moe_time import moe_collectives, moe_mlp_shapes
from megart.plan.timing import layer_work

H100 = load_profile("h100-80gb")
SMALL = dict(vocab_size=256, seq_length=16, hidden_size=32, num_layers=1, num_attention_heads=4,
             num_experts=4, bias=False, moe_ffn_hidden_size=24)  # fmt: skip
# (GPTConfig fields, sequence length, batch, bf16 autocast)
CASES = {
    "gelu top2": (dict(SMALL), 16, 3, False),
    "swiglu aux z-loss": (
        dict(SMALL, activation="swiglu", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
        16, 3, False,
    ),
    "bf16 top1 pre-softmax": (
        dict(SMALL, moe_router_topk=1, moe_router_pre_softmax=True), 16, 2, True,
    ),
    "bf16 fp32 router aux": (
        dict(SMALL, moe_router_dtype="fp32", moe_aux_loss_coeff=0.01), 16, 2, True,
    ),
    # Shared experts: a dense MLP's gather and reduce-scatter each way, S/t wide products.
    "swiglu shared experts": (
        dict(SMALL, activation="swiglu", moe_shared_expert_intermediate_size=40), 16, 3, False,
    ),
    "bf16 shared experts aux": (
        dict(SMALL, moe_shared_expert_intermediate_size=40, moe_aux_loss_coeff=0.01), 16, 2, True,
    ),
    # The gate: x . w over this rank's slice, no collective of its own in the layer.
    "swiglu gated shared experts": (
        dict(SMALL, activation="swiglu", moe_shared_expert_intermediate_size=40,
             moe_shared_expert_gate=True), 16, 3, False,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    """Each case's record on each of the two ranks (one launch for all)."""
    ranks = launch(pmw.collectives_and_flops, pmw.TP, list(CASES.values()), timeout=300)
    return {name: [r[i] for r in ranks] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_the_moe_collectives_are_what_a_tp2_layer_runs(name, measured):
    kw, s, b, bf16 = CASES[name]
    forward, backward = moe_collectives(GPTConfig(**kw), s * b, 2 if bf16 else 4)
    for rank in measured[name]:
        assert Counter(map(tuple, rank["forward"])) == Counter(forward), (name, rank)
        assert Counter(map(tuple, rank["backward"])) == Counter(backward), (name, rank)


@pytest.mark.parametrize("name", list(CASES))
def test_the_moe_products_are_torchs_count_at_tp2(name, measured):
    """The router's over this rank's s/t tokens and the experts' over all k T tokens at f/t:
    balanced rows in the plan, the same FLOPs as any routing."""
    kw, s, b, _ = CASES[name]
    shapes = moe_mlp_shapes(GPTConfig(**kw), s * b, pmw.TP)
    want = sum(2 * rows * cols * inner * n for rows, cols, inner, n in shapes)
    for rank in measured[name]:
        assert rank["flops"] == pytest.approx(want, rel=1e-12), (name, rank)


@pytest.mark.parametrize("overlap", [False, KEPT_INPUT_OVERLAP])
def test_an_moe_layer_adds_its_collectives_to_the_attentions_exposed(overlap):
    """A Mixtral-sized layer at t = 2 with sequence parallelism: its tensor-parallel time is
    the attention's (as a dense layer's first half) plus every MoE collective, exposed; at
    t = 1 none."""
    cfg = GPTConfig(vocab_size=32000, seq_length=4096, hidden_size=4096, num_layers=32,
                    num_attention_heads=32, ffn_hidden_size=14336, activation="swiglu",
                    bias=False, num_experts=8, moe_aux_loss_coeff=0.01)  # fmt: skip
    dense = GPTConfig(**{**cfg.__dict__, "num_experts": None, "moe_aux_loss_coeff": 0.0})
    b, t, tokens = 1, 2, 4096
    link = H100.nvlink_bus_gb_per_s
    moe = layer_work(cfg, b, t, True, None, H100, tp_overlap=overlap, moe=True)
    plain = layer_work(dense, b, t, True, None, H100, tp_overlap=False)
    fwd, bwd = (sum(collective_seconds(k, n, t, link, H100) for k, n in passes)
                for passes in moe_collectives(cfg, tokens, 2))  # fmt: skip
    attention = plain.tp_comm / 2  # a dense layer's halves are alike without overlap
    if overlap:
        # megart's backward overlap hides part of q/k/v's input-gradient reduce-scatter only.
        assert attention / 2 < moe.tp_comm - fwd - bwd < attention
    else:
        assert moe.tp_comm == pytest.approx(attention + fwd + bwd, rel=1e-12)
    assert layer_work(cfg, b, 1, False, None, H100, moe=True).tp_comm == 0.0
