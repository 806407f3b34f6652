"""megart plan with multi-token prediction's MoE depths (a depth's layer is the last decoder
layer's kind, models.mtp; plan.parameters, plan.mtp_memory, plan.mtp_time): against real megart
train ranks with the routing prescribed (plan_moe_ep_workers), the parameter, gradient and
optimizer bytes exactly (ep1, ep2, ep2 x pp2, with and without the distributed optimizer, the
depths' experts in the experts' bucket set) and the activations autograd saves at the peak
within 1% (the depths' losses' few bytes a token are not counted, as for dense depths:
tests/test_plan_memory_mla.py). A depth modelled dense where it is MoE, or its experts counted
whole on every expert-parallel rank, is caught. Its time: the depth's layer is the decoder's
MoE layer's (router, experts, all-to-alls), and the command line plans the combination."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from unittest import mock

import pytest

import plan_moe_ep_workers as pw
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.plan import activations as act
from megart.plan import load_profile
from megart.plan import mtp_memory as mm
from megart.plan import parameters as pa
from megart.plan.estimate import estimate
from megart.plan.layout import Layout
from megart.plan.memory import precision
from megart.plan.moe_time import expert_exchanges
from megart.plan.mtp_time import mtp_work
from megart.plan.timing import layer_work
from megart.training.config import TrainConfig
from plan_memory_check import SMALL, predicted_and_held

# Every layer MoE (so the depths' too), rope, two depths; 64 tokens a microbatch.
MOE = dict(SMALL, position_embedding_type="rope", num_experts=4, moe_ffn_hidden_size=48,
           disable_bias_linear=True, micro_batch_size=2, mtp_num_layers=2,
           moe_aux_loss_coeff=0.01)  # fmt: skip
EP2 = dict(MOE, expert_model_parallel_size=2)
PP2 = dict(pipeline_model_parallel_size=2)
DISTOPT = dict(use_distributed_optimizer=True)


def _first_rank_takes_all(held: dict) -> float:
    """Every token to experts 0..k-1, rank 0's at ep2 (plan_moe_ep_workers' "first")."""
    return 2.0 if held["dp_rank"] % 2 == 0 else 0.0


# (name, processes, flags, routing)
CASES = [
    # The same model without experts: its dense depths' uncounted loss bytes are every case's.
    ("dense", 1, {k: v for k, v in MOE.items() if not k.startswith(("num_exp", "moe_"))},
     "balanced"),
    ("ep1", 1, MOE, "balanced"),
    ("ep2", 2, EP2, "balanced"),
    ("ep2 all to rank 0", 2, EP2, "first"),
    ("ep2 distributed optimizer", 2, dict(EP2, **DISTOPT), "balanced"),
    ("ep2 pp2", 4, dict(EP2, **PP2), "balanced"),
    ("ep2 pp2 distributed optimizer", 4, dict(EP2, **PP2, **DISTOPT), "balanced"),
    # Layer 3 dense: the depths' layers are dense, the decoder's first three MoE.
    ("ep2 pattern last dense", 2, dict(EP2, moe_layer_freq="[1,1,1,0]"), "balanced"),
    ("ep2 swiglu shared z-loss", 2,
     dict(EP2, swiglu=True, moe_shared_expert_intermediate_size=32, moe_z_loss_coeff=0.001),
     "balanced"),
    ("ep2 full uniform", 2, dict(EP2, recompute_granularity="full", recompute_method="uniform",
                                 recompute_num_layers=1), "balanced"),
    ("ep2 recompute moe", 2, dict(EP2, recompute_granularity="selective",
                                  recompute_modules=["moe"]), "balanced"),
]  # fmt: skip


_RANKS: dict[str, list[dict]] = {}


def _predicted(name: str) -> list[tuple[dict, dict, float]]:
    """(held, predicted, a CPU's extra) per rank of case ``name``, its ranks run once."""
    _, nproc, kw, routing = next(c for c in CASES if c[0] == name)
    share = (lambda held: 1.0) if routing == "balanced" else _first_rank_takes_all
    if name not in _RANKS:
        _RANKS[name] = launch(pw.routed_held_bytes, nproc, kw, routing, timeout=300)
    pa.state_bytes.cache_clear()  # a mistake's patch must not be served from the cache
    return predicted_and_held(nproc, kw, expert_tokens=share, ranks=_RANKS[name])


def _offs(name: str) -> dict[str, float]:
    """The largest relative difference over the ranks of each part: the state's exact
    parts, and the saved peak from the plan's saves (a CPU's extra added)."""
    out = dict.fromkeys(("parameters", "gradients", "optimizer", "saved"), 0.0)
    for held, want, cpu in _predicted(name):
        for part in ("parameters", "gradients", "optimizer"):
            out[part] = max(out[part], abs(want[part] / held[part] - 1))
        out["saved"] = max(out["saved"], abs(held["saved_peak"] / (want["saved"] + cpu) - 1))
        assert held["saved_after"] == 0
    return out


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_predicted_moe_depth_bytes_are_what_a_rank_holds(name):
    """The state exactly; the saves within 1%, and off by exactly what the dense model's
    depths are off by on their last stage (their losses' few bytes): the MoE terms exact."""
    offs = _offs(name)
    assert offs["parameters"] == offs["gradients"] == offs["optimizer"] == 0.0, offs
    assert offs["saved"] < 0.01, offs
    ((dense_held, dense, dense_cpu),) = _predicted("dense")
    gap = dense_held["saved_peak"] - dense["saved"] - dense_cpu
    assert gap > 0
    kw = next(c[2] for c in CASES if c[0] == name)
    for held, want, cpu in _predicted(name):
        last = held["pp_rank"] == kw.get("pipeline_model_parallel_size", 1) - 1
        assert held["saved_peak"] - want["saved"] - cpu == (gap if last else 0), (name, held)
        if kw.get("recompute_method") == "uniform":  # the replay's peak, as the MLA tests'
            c = TrainConfig(**kw)
            where = (c.gpt_config(), c.micro_batch_size, c.tp, c.sequence_parallel,
                     precision(c, "megart"))  # fmt: skip
            loss = act.last_stage_bytes(*where) + mm.mtp_loss_bytes(*where)
            peak = want["saved"] - loss + want["recompute_working"]
            assert held["recompute_peak"] == pytest.approx(peak, rel=0.05), (name, held, want)


def _depths_dense(self: GPTConfig, layer: int, real=GPTConfig.is_moe_layer) -> bool:
    return layer < self.num_layers and real(self, layer)


def _experts_whole(cfg, tp, ep=1, experts=None, real=pa.mtp_tensors):  # noqa: ANN001, ANN202
    return real(cfg, tp, 1, experts)


def _experts_dense(cfg, tp, ep=1, experts=None, real=pa.mtp_tensors):  # noqa: ANN001, ANN202
    return [] if experts else real(cfg, tp, ep, None)


# (mistake, its patch, the case it is tried on, the parts it must move past the tolerance)
MISTAKES = [
    ("depths dense", mock.patch.object(GPTConfig, "is_moe_layer", _depths_dense), "ep2",
     ("parameters", "gradients", "optimizer", "saved")),
    ("depths dense on pp2's last stage", mock.patch.object(GPTConfig, "is_moe_layer",
                                                            _depths_dense), "ep2 pp2",
     ("parameters", "saved")),
    ("depths' saves dense", mock.patch.object(mm, "moe_layer_extra", lambda *a: 0.0), "ep2",
     ("saved",)),
    ("depths' experts whole on each expert-parallel rank",
     mock.patch.object(pa, "mtp_tensors", _experts_whole), "ep2", ("parameters", "optimizer")),
    ("depths' experts in the dense bucket set",
     mock.patch.object(pa, "mtp_tensors", _experts_dense), "ep2 distributed optimizer",
     ("optimizer",)),
    ("depths' experts getting balanced copies", mock.patch.object(
        mm, "moe_layer_extra", lambda cfg, b, rec, rank, real=mm.moe_layer_extra: real(
            cfg, b, rec, dataclasses.replace(rank, expert_tokens=1.0))), "ep2 all to rank 0",
     ("saved",)),
]  # fmt: skip


@pytest.mark.parametrize("mistake,patch,name,parts", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistaken_depth_model_is_caught(mistake, patch, name, parts):
    """Each mistake moves the parts it touches past the tests' tolerances (the report's
    figures: bench/RESULTS.md)."""
    with patch:
        offs = _offs(name)
    pa.state_bytes.cache_clear()
    print(mistake, {k: f"{v:.2%}" for k, v in offs.items()})
    for part in parts:
        assert offs[part] > (0.01 if part == "saved" else 0.0), (mistake, offs)


def _depth_moe_layers(cfg: GPTConfig, ep: int) -> float:
    """The MoE layers' all-to-alls plan.mtp_time times for the depths, in one MoE layer's."""
    gpu = load_profile("h100-80gb")
    one = layer_work(cfg, 2, 1, False, None, gpu, moe=True, ep=ep, ep_near=ep).ep_comm
    return mtp_work(cfg, 2, 1, False, gpu, gpu, ep=ep, ep_near=ep).ep_comm / one


@pytest.mark.parametrize("name", ["ep2", "ep2 pattern last dense"])
def test_the_depths_post_the_all_to_alls_the_plan_times(name):
    """Real ep2 ranks' send buffers in a training step (balanced routing): each MoE layer's
    expert_exchanges per microbatch, forward and backward, the depths' MoE layers among them
    as many as plan.mtp_time times (two; none where the last decoder layer is dense)."""
    _, nproc, kw, _ = next(c for c in CASES if c[0] == name)
    c = TrainConfig(**kw)
    cfg = c.gpt_config()
    depths = _depth_moe_layers(cfg, 2)
    assert depths == pytest.approx(2.0 if cfg.is_moe_layer(cfg.num_layers) else 0.0)
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) + round(depths)
    m = c.global_batch_size // (c.micro_batch_size * nproc)
    fwd, bwd = expert_exchanges(cfg, c.seq_length * c.micro_batch_size, 4)
    want = Counter()
    for n in fwd + bwd:
        want[n] += m * layers
    for rank in launch(pw.routed_exchanges, nproc, kw, "balanced", timeout=300):
        assert Counter(rank) == want, (name, Counter(rank), want)


BIG = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048,
           vocab_size=32000, global_batch_size=64, num_experts=8, disable_bias_linear=True,
           bf16=True, mtp_num_layers=2)  # fmt: skip


@pytest.mark.parametrize("freq,depth_moe", [("[1,0,1,1]", True), ("[1,1,1,0]", False)])
def test_an_iterations_ep_comm_counts_the_moe_depths(freq, depth_moe):
    """estimate(): m microbatches through the stage's MoE layers and the depths' (MoE where
    the last decoder layer is), each one MoE layer's all-to-alls (the group of 8 in a node);
    the depths' experts' buckets reduced with the decoder's."""
    c = TrainConfig(**BIG, moe_layer_freq=freq)
    gpu = load_profile("h100-80gb")
    layout = Layout(1, 1, 16, 1, 2, False, None, False, ep=8)
    e = estimate(c, layout, gpu)
    cfg = c.gpt_config()
    one = layer_work(cfg, 2, 1, False, None, gpu, moe=True, ep=8, ep_near=8)
    layers = 3 + 2 * depth_moe
    assert e.time["ep_comm"] == pytest.approx(e.microbatches * layers * one.ep_comm, rel=1e-12)
    expert = layers * (8 // 8) * 2 * cfg.moe_ffn_size * 1024 * 4  # an expert's fc and proj
    assert e.memory["expert_gradient_buffers"] == expert


ARGV = (
    "plan --gpu h100-80gb --num-gpus 16 --num-layers 4 --hidden-size 1024 "
    "--num-attention-heads 16 --seq-length 2048 --global-batch-size 64 "
    "--position-embedding-type rope --num-experts 8 --disable-bias-linear --json --top 400"
)


def test_the_cli_plans_moe_depths_with_expert_parallelism(capsys):
    """Planned (no longer refused): expert parallelism searched, its all-to-alls timed, and
    on a given layout the depth's MoE layer adds parameters and time to the last stage."""
    assert megart_main(f"{ARGV} --mtp-num-layers 1".split()) == 0
    found = json.loads(capsys.readouterr().out)["candidates"]
    spread = [c for c in found if c["layout"]["ep"] > 1]
    assert {c["layout"]["ep"] for c in spread} >= {2, 4, 8}
    assert all(c["time_s"]["ep_comm"] > 0 for c in spread)
    fixed = f"{ARGV} --expert-model-parallel-size 4 --pipeline-model-parallel-size 2"
    plans = []
    for extra in ("", " --mtp-num-layers 1"):
        assert megart_main(f"{fixed}{extra} --micro-batch-size 1 --top 1".split()) == 0
        plans.append(json.loads(capsys.readouterr().out)["candidates"][0])
    without, with_depth = plans
    for part in ("parameters", "total"):
        assert with_depth["memory_gib"][part] > without["memory_gib"][part], part
    assert with_depth["time_s"]["ep_comm"] > without["time_s"]["ep_comm"]
