"""gpt-oss's MLP activation, Megatron-LM's --quick-geglu with --glu-linear-offset and
--activation-func-clamp-value (megart.models.mlp.MLP.act): against Megatron-Core 0.16.1's
GPTModel (local spec, float64, CPU) both ways, logits and one step's gradients, dense and
mixture-of-experts, at tensor-parallel sizes 1 and 2; planted mistakes show; and what is
refused, by name."""

import pytest

import glu_workers as gw
import megatron_core_workers as mcw
import moe_tp_workers as mtw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPTConfig

BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            position_embedding="rotary", activation="quick_geglu")  # fmt: skip
# gpt-oss's offset 1; a clamp small enough to cut these drawn weights' products often.
OSS = dict(glu_linear_offset=1.0, activation_func_clamp_value=0.05)
MOE = dict(num_experts=4, moe_router_topk=2, bias=False)
MODELS = {
    "plain": {},
    "oss": OSS,
    "oss-no-bias": dict(OSS, bias=False),
    "oss-moe": dict(OSS, **MOE),
    "oss-moe-shared": dict(OSS, **MOE, moe_shared_expert_intermediate_size=24),
}


@pytest.fixture(scope="module")
def against_megatron_core():
    return mcw.compare_named(BASE, MODELS)


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_computes_the_same_logits_both_ways(against_megatron_core, name):
    r = against_megatron_core[name]
    if "moe" not in name:
        mcw.assert_same_both_ways(r)
    else:  # its softmax over experts rounds to fp32
        assert r["scale"] > 0.1 and max(r["forward"], r["reverse"]) < 1e-6, r


@pytest.mark.parametrize("tp", [1, 2])
def test_dense_logits_and_gradients_are_megatron_cores(tp):
    for worst in launch(gw.against_megatron_core, tp, dict(BASE, **OSS), timeout=300):
        assert max(worst.values()) < 1e-10, worst


def test_expert_logits_and_gradients_are_megatron_cores_at_tp1():
    worst = launch(gw.against_megatron_core, 1, dict(BASE, **OSS, **MOE), timeout=300)[0]
    assert any("experts.3.gate" in n for n in worst)
    assert max(worst.values()) < 1e-6, worst


def test_expert_logits_and_gradients_are_megatron_cores_at_tp2_with_sp():
    """moe_tp_workers.compare: megart's tp2 shards against Megatron-Core's (--sequence-parallel)
    and megart's one process, one step's gradients the routers' included."""
    r = launch(mtw.compare_all, 2, [(dict(BASE, **OSS, **MOE), 0.5, None)], timeout=300)[0][0]
    assert r["scale"] > 0.5 and r["top"] > 1e-3
    assert r["megatron_logits"] < 1e-6 and r["one_process_logits"] < 1e-12
    assert r["largest"] < 1e-6 and r["router"] < 1e-6


@pytest.mark.parametrize("mistake", ["offset-on-gate", "no-clamp", "clamp-gate-both-sides"])
def test_the_comparison_catches_a_misplaced_offset_or_clamp(mistake):
    for kw in (dict(BASE, **OSS), dict(BASE, **OSS, **MOE)):
        worst = launch(gw.against_megatron_core, 1, kw, mistake, timeout=300)[0]
        assert worst["logits"] > 1e-3, (mistake, worst)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(activation="swiglu", glu_linear_offset=1.0), "--glu-linear-offset set the gated"),
        (dict(activation="gelu", activation_func_clamp_value=7.0), "give --quick-geglu"),
        (dict(activation_func_clamp_value=0.0), "give a positive number"),
        (dict(glu_linear_offset=float("inf")), "give a finite number"),
    ],
)
def test_what_megart_cannot_take_is_refused_by_name(kw, says):
    with pytest.raises(ConfigError, match=says):
        GPTConfig(**{**BASE, **kw})


def test_grouped_experts_are_the_loop_of_experts():
    """--moe-grouped-gemm (models.moe_grouped) computes the same quick GeGLU as the loop."""
    import torch

    from megart.models.moe import AuxLossScale, MoE

    cfg = GPTConfig(**{**BASE, **OSS, **MOE, "hidden_size": 16, "num_attention_heads": 2})
    x = torch.randn(12, 1, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    results = []
    for grouped in (False, True):
        torch.manual_seed(0)
        moe = MoE(cfg, 0, AuxLossScale()).double()
        if grouped:
            moe.group()
        xi = x.clone().requires_grad_()
        y = moe(xi)
        y.pow(2).sum().backward()
        results.append([y.detach(), xi.grad])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
