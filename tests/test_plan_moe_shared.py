"""megart plan with shared experts (--moe-shared-expert-intermediate-size) and selective
recomputation of MoE layers (--recompute-modules moe, shared_experts; plan.moe_memory,
plan.moe_time, plan.parameters, timing.layer_work, estimate's FLOPs): against real megart train
ranks at tp1, tp2 with sequence parallelism and ep2 (the routing prescribed,
plan_moe_ep_workers), the parameter, gradient and optimizer bytes exactly (the shared experts
in the dense buckets under expert parallelism, the distributed optimizer's shards included),
the activations autograd saves at the peak and the most held while a checkpoint replays
(torch's saved-tensor hooks, tests/plan_workers.py), exactly in fp32 and at tp2 in bf16, within
1% at tp1 in bf16 (the dense layers' known CPU differences, tests/test_plan_memory.py). The
time: the shared experts' products are torch's FLOP count of a real tp2 layer and their
collectives are the ones it runs (tests/test_plan_moe_time.py's cases), the replays add their
forward (all-to-alls included) to the backward and their FLOPs to the paper's count; and
properties over small models."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import plan_moe_ep_workers as pw
from megart.models.config import GPTConfig
from megart.plan import load_profile
from megart.plan.activations import Precision, layer_bytes
from megart.plan.collectives import collective_seconds
from megart.plan.estimate import estimate
from megart.plan.layout import Layout
from megart.plan.moe_memory import (
    MoeRank,
    checkpointed_mlp_bytes,
    moe_layer_extra,
    moe_replay_bytes,
)
from megart.plan.moe_time import (
    expert_exchange_seconds,
    moe_collectives,
    moe_mlp_shapes,
    shared_collectives,
    shared_mlp_shapes,
)
from megart.plan.parameters import state_bytes
from megart.plan.timing import gemm_seconds, layer_work
from megart.training.config import TrainConfig
from plan_memory_check import SMALL, predicted_and_held
from test_plan_memory_moe import _replay_peak
from test_plan_moe_ep import _candidates, _first_rank_takes_all

SHARED = dict(SMALL, num_experts=4, moe_ffn_hidden_size=48, disable_bias_linear=True,
              micro_batch_size=2, moe_shared_expert_intermediate_size=40)  # fmt: skip
TP2 = dict(SHARED, tensor_model_parallel_size=2, sequence_parallel=True)
EP2 = dict(SHARED, expert_model_parallel_size=2)
# bf16 at t = 1: 160 tokens a microbatch, so that no saved tensor is shaped as a weight.
BF16 = dict(SHARED, bf16=True, micro_batch_size=5, global_batch_size=20)


def _modules(*names: str) -> dict:
    return dict(recompute_granularity="selective", recompute_modules=list(names))


# (name, processes, flags, routing: None (the router's own) or plan_moe_ep_workers', exact)
CASES = [
    ("tp1 gelu", 1, SHARED, None, True),
    ("tp1 swiglu shared_experts", 1, dict(SHARED, swiglu=True, **_modules("shared_experts")),
     None, True),
    ("tp1 aux core_attn moe", 1,
     dict(SHARED, moe_aux_loss_coeff=0.01, **_modules("core_attn", "moe")), None, True),
    ("tp1 sigmoid aux z-loss moe", 1,
     dict(SHARED, moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.01,
          moe_z_loss_coeff=0.001, **_modules("moe")), None, True),
    # The router casts its input: the shared experts' checkpoint keeps the input itself.
    ("tp1 fp64 router shared_experts", 1,
     dict(SHARED, moe_router_dtype="fp64", **_modules("shared_experts")), None, True),
    ("tp1 fp64 router moe", 1, dict(SHARED, moe_router_dtype="fp64", **_modules("moe")), None,
     True),
    # The last layer an MoE layer, whose replay rises more than a dense MLP's.
    ("tp1 dense-moe pattern mlp moe", 1,
     dict(SHARED, moe_layer_freq="[0,1,0,1]", **_modules("mlp", "moe")), None, True),
    ("tp1 moe without shared experts", 1,
     dict(SHARED, moe_shared_expert_intermediate_size=None, **_modules("moe")), None, True),
    ("tp2 sp gelu", 2, TP2, None, True),
    ("tp2 sp swiglu moe", 2, dict(TP2, swiglu=True, **_modules("moe")), None, True),
    ("tp2 sp shared_experts", 2, dict(TP2, **_modules("shared_experts")), None, True),
    ("tp2 sp bf16 swiglu moe", 2, dict(TP2, swiglu=True, bf16=True, micro_batch_size=4,
                                       **_modules("moe")), None, True),
    ("ep2 balanced", 2, EP2, "balanced", True),
    ("ep2 moe all to rank 0", 2, dict(EP2, **_modules("moe")), "first", True),
    ("ep2 swiglu shared_experts balanced", 2,
     dict(EP2, swiglu=True, **_modules("shared_experts")), "balanced", True),
    ("ep2 dp4 distributed optimizer balanced", 4,
     dict(EP2, use_distributed_optimizer=True, global_batch_size=16), "balanced", True),
    ("tp1 bf16", 1, BF16, None, False),
    ("tp1 bf16 fp32 router shared_experts", 1,
     dict(BF16, moe_router_dtype="fp32", **_modules("shared_experts")), None, False),
]  # fmt: skip


def _ranks(nproc: int, kw: dict, routing: str | None) -> list[tuple[dict, dict, float]]:
    if routing is None:
        return predicted_and_held(nproc, kw)
    share = (lambda held: 1.0) if routing == "balanced" else _first_rank_takes_all
    return predicted_and_held(nproc, kw, pw.routed_held_bytes, (routing,), share)


@pytest.mark.parametrize("name,nproc,kw,routing,exact", CASES, ids=[c[0] for c in CASES])
def test_predicted_bytes_are_what_a_rank_holds(name, nproc, kw, routing, exact):
    """The state exactly; the saves at the peak and the most held while the checkpoint of an
    MoE layer or of its shared experts replays (the replay's saves above the rank's saves less
    the loss's, which its backward frees first: recompute_working)."""
    check_ranks(name, nproc, kw, routing, exact)


def check_ranks(name: str, nproc: int, kw: dict, routing: str | None, exact: bool) -> None:
    """test_predicted_bytes_are_what_a_rank_holds' check of one case (shared with
    tests/test_plan_moe_gate.py)."""
    close = (lambda x: x) if exact else (lambda x: pytest.approx(x, rel=0.01))
    replayed = set(kw.get("recompute_modules", ())) & {"mlp", "moe", "shared_experts"}
    for held, want, cpu in _ranks(nproc, kw, routing):
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])
        assert held["saved_peak"] == close(want["saved"] + cpu), (name, held, want)
        assert held["saved_after"] == 0
        assert (want["recompute_working"] > 0) == bool(replayed), (name, want)
        if not replayed:
            continue
        peak = held["recompute_peak"]
        if "moe" in replayed and kw.get("moe_aux_loss_coeff"):
            # The hooks may count the replay's load-balancing top-k indices, freed at once
            # (plan.moe_memory's doc): as many more bytes at most, never fewer.
            c = TrainConfig(**kw)
            tokens = c.seq_length * c.micro_batch_size / (c.tp if c.sequence_parallel else 1)
            assert 0 <= peak - _replay_peak(kw, want) <= tokens * 8 * c.moe_router_topk, name
        else:
            assert peak == close(_replay_peak(kw, want)), (name, held, want)


@pytest.mark.parametrize("kw", [SHARED, TP2], ids=["tp1", "tp2 sp"])
def test_nested_replays_are_both_held(kw):
    """moe and shared_experts named together: the layer's replay stops at the shared experts'
    checkpoint (their input is its last save), and theirs follows at once while the layer's
    replayed saves wait for their backward. The hooks see each replay apart (the most held
    with the layer's); the plan counts both at once, the shared experts' MLP on top."""
    kw = dict(kw, **_modules("moe", "shared_experts"))
    c = TrainConfig(**kw)
    cfg, b, t = c.gpt_config(), c.micro_batch_size, c.tp
    inner = checkpointed_mlp_bytes(cfg, b, t, c.sequence_parallel, Precision(4, 4), 1, 40)
    for held, want, cpu in predicted_and_held(t, kw):
        assert held["saved_peak"] == want["saved"] + cpu, (held, want)
        assert held["recompute_peak"] == _replay_peak(kw, want) - inner, (held, want, inner)


def _state(cfg: GPTConfig, ep: int = 1, distributed: bool = False, dp: int = 1):
    return state_bytes(cfg, 1, 1, 0, 1, dp, distributed, ep=ep)


SMALL_CFG = dict(vocab_size=256, seq_length=64, hidden_size=64, num_layers=4,
                 num_attention_heads=4, bias=False, moe_ffn_hidden_size=32)  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(
    experts=st.sampled_from([4, 8]),
    k=st.integers(1, 2),
    swiglu=st.booleans(),
    freq=st.sampled_from([1, 2]),
    width=st.sampled_from([16, 48, 128]),
    tp=st.sampled_from([1, 2]),
    bf16=st.booleans(),
    aux=st.booleans(),
)
def test_shared_experts_never_lower_bytes_and_moe_recomputation_never_keeps_more(
    experts, k, swiglu, freq, width, tp, bf16, aux
):
    """Shared experts add parameters, saves, products and (replicated, outside the experts'
    set) no expert gradients; --recompute-modules moe keeps no more than no recomputation or
    shared_experts, and shared_experts no more than none; each replay rises by no more than
    the layer saves without recomputation."""
    base = GPTConfig(**SMALL_CFG, num_experts=experts, moe_router_topk=k,
                     moe_router_pre_softmax=k == 1, activation="swiglu" if swiglu else "gelu",
                     moe_layer_freq=freq, moe_aux_loss_coeff=0.01 if aux else 0.0)  # fmt: skip
    shared = dataclasses.replace(base, moe_shared_expert_intermediate_size=width)
    prec, sp = Precision(2, 2) if bf16 else Precision(4, 4), tp > 1
    rank = MoeRank(prec, tp=tp, sp=sp)
    for ep in (1, 2):
        plain, more = _state(base, ep), _state(shared, ep)
        assert more.parameters > plain.parameters and more.gradients > plain.gradients
        assert more.expert_gradients == plain.expert_gradients
    assert sum(2 * r * c * i * n for r, c, i, n in shared_mlp_shapes(shared, 64, tp)) > 0

    def kept(cfg: GPTConfig, *modules: str) -> float:
        c = dataclasses.replace(cfg, recompute_granularity="selective" if modules else None,
                                recompute_modules=modules or ("core_attn",))  # fmt: skip
        rec = c.recompute_granularity
        return layer_bytes(c, 2, tp, sp, rec, prec) + moe_layer_extra(c, 2, rec, rank)

    assert kept(shared) > kept(base)
    assert kept(shared, "moe") <= kept(shared, "shared_experts") <= kept(shared)
    assert kept(shared, "moe") == kept(base, "moe") <= kept(base)
    for modules in (("moe",), ("shared_experts",)):
        c = dataclasses.replace(shared, recompute_granularity="selective",
                                recompute_modules=modules)  # fmt: skip
        # The replay makes again what the checkpoint dropped.
        dropped = kept(shared) - kept(shared, *modules)
        rise = moe_replay_bytes(c, 2, rank)
        assert rise == pytest.approx(dropped, rel=1e-12) and rise > 0, modules


H100 = load_profile("h100-80gb")
MIXTRAL = GPTConfig(vocab_size=32000, seq_length=4096, hidden_size=4096, num_layers=32,
                    num_attention_heads=32, ffn_hidden_size=14336, activation="swiglu",
                    bias=False, num_experts=8, moe_aux_loss_coeff=0.01,
                    moe_shared_expert_intermediate_size=8192)  # fmt: skip


def _recomputing(cfg: GPTConfig, *modules: str) -> GPTConfig:
    return dataclasses.replace(cfg, recompute_granularity="selective", recompute_modules=modules)


@pytest.mark.parametrize("t,ep", [(1, 1), (2, 1), (1, 8)], ids=["tp1", "tp2 sp", "ep8"])
def test_a_replay_adds_its_forward_to_the_backward(t, ep):
    """shared_experts: the shared products and activation once more, and at t > 1 their gather
    and reduce-scatter; moe: the whole MoE part's forward (router, experts, shared experts, the
    dispatcher's collectives, the all-to-alls); both: moe's alone (nested, run once)."""
    sp = t > 1

    def work(cfg: GPTConfig):
        return layer_work(cfg, 1, t, sp, cfg.recompute_granularity, H100, moe=True, ep=ep)

    plain = work(_recomputing(MIXTRAL, "core_attn"))
    shared = work(_recomputing(MIXTRAL, "core_attn", "shared_experts"))
    moe = work(_recomputing(MIXTRAL, "core_attn", "moe"))
    both = work(_recomputing(MIXTRAL, "core_attn", "moe", "shared_experts"))
    assert plain.forward == shared.forward == moe.forward == both.forward
    assert plain.backward < shared.backward < moe.backward == both.backward
    tokens, link = 4096, H100.nvlink_bus_gb_per_s

    def seconds(passes: list[tuple[str, float]]) -> float:
        return sum(collective_seconds(kind, n, t, link, H100) for kind, n in passes) if t > 1 else 0

    # Collectives: the shared experts' forward pair under shared_experts, every forward one of
    # the MoE part under moe; all-to-alls: the forward's four under moe alone.
    assert shared.tp_comm - plain.tp_comm == pytest.approx(
        seconds(shared_collectives(MIXTRAL, tokens, 2)[0]), rel=1e-9, abs=1e-15
    )
    assert moe.tp_comm - plain.tp_comm == pytest.approx(
        seconds(moe_collectives(MIXTRAL, tokens, 2)[0]), rel=1e-9, abs=1e-15
    )
    a2a = expert_exchange_seconds(MIXTRAL, tokens, ep, ep, H100, 2)[0] if ep > 1 else 0.0
    assert shared.ep_comm == plain.ep_comm
    assert moe.ep_comm - plain.ep_comm == pytest.approx(a2a, rel=1e-9, abs=1e-15)
    # The products: the shared experts' (S/t wide over every token), or all of the MoE part's.
    gemm = [gemm_seconds(r, c, i, H100, n) for r, c, i, n in moe_mlp_shapes(MIXTRAL, tokens, t, ep)]
    assert shared.backward - plain.backward > sum(gemm[-2:]) + seconds(
        shared_collectives(MIXTRAL, tokens, 2)[0]
    )
    assert moe.backward - plain.backward > sum(gemm) + a2a
    assert moe.backward - plain.backward < plain.forward  # not the attention's again


def test_the_paper_count_adds_the_replayed_products():
    """estimate's FLOPs: the model's count holds the shared experts (Megatron's k f + S), and
    the run's adds, for every MoE layer, (k f + S) wide MLP products once more under moe, S
    wide under shared_experts, as training.flops counts an MLP's forward."""
    base = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                vocab_size=32000, global_batch_size=32, num_experts=8, disable_bias_linear=True,
                moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=1536, bf16=True,
                moe_layer_freq="[1,0,1,1]", recompute_granularity="selective")  # fmt: skip
    layout = Layout(1, 1, 8, 1, 1, False, "selective", False)
    one = 2 * 2 * 32 * 2048 * 1024  # an MLP's forward products per unit of width, batch 32

    def run(*modules: str) -> float:
        e = estimate(TrainConfig(**base, recompute_modules=list(modules)), layout, H100)
        world = 8
        return e.tflops_per_gpu * e.time["iteration"] * world * 1e12, e

    plain, e0 = run("core_attn")
    moe, e1 = run("core_attn", "moe")
    shared, e2 = run("core_attn", "shared_experts")
    assert moe - plain == pytest.approx(3 * one * (512 * 2 + 1536), rel=1e-9)
    assert shared - plain == pytest.approx(3 * one * 1536, rel=1e-9)
    for e in (e1, e2):
        assert e.time["iteration"] > e0.time["iteration"]
        model = e.model_tflops_per_gpu * e.time["iteration"]
        assert model == pytest.approx(e0.model_tflops_per_gpu * e0.time["iteration"], rel=1e-9)


ARGV = (
    "plan --gpu h100-80gb --num-gpus 16 --num-layers 4 --hidden-size 1024 "
    "--num-attention-heads 16 --seq-length 2048 --global-batch-size 64 "
    "--num-experts 8 --disable-bias-linear --json --top 400 --pipeline-model-parallel-size 1 "
    "--micro-batch-size 1"
)


def _by_layout(found: list[dict]) -> dict:
    return {json.dumps(c["layout"], sort_keys=True): c for c in found}


def test_the_cli_plans_shared_experts_and_their_recomputation(capsys):
    """The same layouts (tensor and expert parallelism among them) with shared experts hold
    more parameters and activations and take longer; --recompute-modules moe keeps fewer
    activations and takes longer still than the same layout without it."""
    plain = _by_layout(_candidates(ARGV, capsys))
    shared_argv = f"{ARGV} --moe-shared-expert-intermediate-size 2048"
    shared = _by_layout(_candidates(shared_argv, capsys))
    common = plain.keys() & shared.keys()
    assert any(json.loads(k)["ep"] > 1 for k in common)
    assert any(json.loads(k)["tp"] > 1 for k in common)
    for k in common:
        a, b = plain[k], shared[k]
        assert b["memory_gib"]["parameters"] > a["memory_gib"]["parameters"]
        assert b["memory_gib"]["activations"] > a["memory_gib"]["activations"]
        assert b["iteration_time_s"] > a["iteration_time_s"]
    selective = f"{shared_argv} --recompute-activations --recompute-modules core_attn"
    kept = _by_layout(_candidates(selective, capsys))
    replayed = _by_layout(_candidates(f"{selective} moe", capsys))
    both = kept.keys() & replayed.keys()
    assert both
    for k in both:
        a, b = kept[k], replayed[k]
        assert b["memory_gib"]["activations"] < a["memory_gib"]["activations"]
        assert b["iteration_time_s"] > a["iteration_time_s"]


def test_moe_mlp_shapes_hold_the_shared_experts():
    """The shared experts' products follow the router's and the experts': over every token of
    the (gathered) sequence, S/t wide, the same on every expert-parallel rank."""
    cfg = GPTConfig(**SMALL_CFG, num_experts=4, moe_shared_expert_intermediate_size=48)
    for t, ep in ((1, 1), (2, 1), (1, 2)):
        shapes = moe_mlp_shapes(cfg, 128, t, ep)
        assert shapes[-2:] == [(128, 48 / t, 64, 1), (128, 64, 48 / t, 1)]
