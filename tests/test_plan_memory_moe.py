"""megart plan with mixture-of-experts layers (plan.moe_memory, plan.moe_time, plan.parameters):
parameter, gradient and optimizer bytes against real megart train ranks exactly, and the
activations autograd saves at the peak (torch's saved-tensor hooks) exactly in fp32, where the
routing decides which expert gets which token but not the bytes (every expert term is per
token an expert got, k T in all). Under bf16 the dense layers' known CPU differences remain
(tests/test_plan_memory.py's doc; the same bytes as a dense model of these sizes): within 1%.
Under tensor parallelism (tp2 with sequence parallelism, as megart train requires for experts)
each rank holds the router whole and 1/t of every expert, and saves the router's tensors for
its slice of the sequence and the experts' for every gathered token at f/t: exact in fp32 (and
under full recomputation the replay's peak too). And the CLI: --num-experts plans layouts megart
train runs (t > 1 only with sequence parallelism, no zero-bubble schedule; context parallelism
in tests/test_plan_moe_ep_tp.py) and refuses what it does not model. --moe-grouped-gemm's experts
save what the per-expert loop saves: the same exact bytes (in one process, at tp2, and at ep2 in
tests/test_plan_moe_ep.py)."""

from __future__ import annotations

import json

import pytest

from megart.cli.main import main as megart_main
from megart.plan import activations as act
from megart.plan.memory import precision
from megart.training.config import TrainConfig
from plan_memory_check import SMALL, assert_rank_matches, predicted_and_held

MOE = dict(SMALL, num_experts=4, moe_ffn_hidden_size=48, disable_bias_linear=True)
TP2 = dict(MOE, tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=2)

# (name, processes, flags, exact activations)
CASES = [
    ("gelu top2", 1, dict(MOE, micro_batch_size=2), True),
    (
        "swiglu top1 pre-softmax dense-moe pattern",
        1,
        dict(MOE, swiglu=True, moe_router_topk=1, moe_router_pre_softmax=True,
             moe_layer_freq="[1,0,1,0]", micro_batch_size=2),
        True,
    ),
    (
        "pp2 sigmoid aux z-loss",
        2,
        dict(MOE, pipeline_model_parallel_size=2, moe_router_score_function="sigmoid",
             moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, micro_batch_size=2),
        True,
    ),
    (
        "pp2 swiglu fp64 router freq 2",
        2,
        dict(MOE, pipeline_model_parallel_size=2, swiglu=True, moe_layer_freq="2",
             moe_router_dtype="fp64", micro_batch_size=2),
        True,
    ),
    (
        "selective core_attn mlp (dense MLPs only) freq 2",
        1,
        dict(MOE, moe_layer_freq="2", recompute_granularity="selective",
             recompute_modules=["core_attn", "mlp"], micro_batch_size=2),
        True,
    ),
    (
        "pp2 full block 1 pattern",
        2,
        dict(MOE, pipeline_model_parallel_size=2, moe_layer_freq="[1,0,0,1]",
             recompute_granularity="full", recompute_method="block", micro_batch_size=2),
        True,
    ),
    (
        "pp2 bf16 fp32 router aux z-loss",
        2,
        dict(MOE, pipeline_model_parallel_size=2, bf16=True, moe_router_dtype="fp32",
             moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001, micro_batch_size=4),
        False,
    ),
    (
        "dp2 distributed optimizer half weights fp32 router",
        2,
        dict(MOE, use_distributed_optimizer=True, bf16=True, half_weights=True,
             moe_router_dtype="fp32", micro_batch_size=2),
        False,
    ),
    ("tp2 sp gelu top2", 2, TP2, True),
    (
        "tp2 sp swiglu aux z-loss dense-moe pattern",
        2,
        dict(TP2, swiglu=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
             moe_layer_freq="[1,0,1,0]"),
        True,
    ),
    (
        "tp2 sp sigmoid fp64 router aux z-loss",
        2,
        dict(TP2, moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.01,
             moe_z_loss_coeff=0.001, moe_router_dtype="fp64"),
        True,
    ),
    (
        "tp2 sp swiglu top1 pre-softmax selective core_attn mlp freq 2",
        2,
        dict(TP2, swiglu=True, moe_router_topk=1, moe_router_pre_softmax=True, moe_layer_freq="2",
             recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
        True,
    ),
    (
        "tp2 sp full uniform 2 pattern",
        2,
        dict(TP2, moe_layer_freq="[1,0,0,1]", recompute_granularity="full",
             recompute_method="uniform", recompute_num_layers=2),
        True,
    ),
    (
        "tp2 sp bf16 fp32 router aux z-loss",
        2,
        dict(TP2, bf16=True, moe_router_dtype="fp32", moe_aux_loss_coeff=0.01,
             moe_z_loss_coeff=0.001, micro_batch_size=4),
        False,
    ),
    ("tp2 sp bf16 swiglu", 2, dict(TP2, bf16=True, swiglu=True, micro_batch_size=4), False),
    # --moe-grouped-gemm (models.moe_grouped): the same saves as the per-expert loop.
    ("grouped gemm gelu top2", 1, dict(MOE, moe_grouped_gemm=True, micro_batch_size=2), True),
    ("tp2 sp grouped gemm swiglu", 2, dict(TP2, swiglu=True, moe_grouped_gemm=True), True),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,kw,exact", CASES, ids=[c[0] for c in CASES])
def test_predicted_moe_bytes_are_what_a_rank_holds(name, nproc, kw, exact):
    for held, want, cpu in predicted_and_held(nproc, kw):
        assert_rank_matches(name, held, want, cpu, exact)
        if kw.get("recompute_method") == "uniform":  # one stage: the loss's rank
            assert held["recompute_peak"] == _replay_peak(kw, want), (name, held, want)


def _replay_peak(kw: dict, want: dict) -> float:
    """The most a single-stage rank holds while full recomputation replays a span, as the plan
    has it: its saves less the loss's (freed by the loss's backward, before any replay) plus
    recompute_working (tests/test_plan_recompute_method.py)."""
    c = TrainConfig(**kw)
    loss = act.last_stage_bytes(c.gpt_config(), c.micro_batch_size, c.tp, c.sequence_parallel,
                                precision(c, "megart"), c.context_parallel_size)  # fmt: skip
    return want["saved"] - loss + want["recompute_working"]


ARGV = (
    "plan --gpu h100-80gb --num-gpus 8 --num-layers 8 --hidden-size 1024 "
    "--num-attention-heads 16 --seq-length 2048 --global-batch-size 64 "
    "--num-experts 8 --disable-bias-linear --json --top 200"
)


def test_the_cli_plans_moe_layouts_megart_train_runs(capsys):
    """Every candidate megart plan shows for an MoE model is one megart train runs with it and
    the plan models: t > 1 (searched) only with sequence parallelism (megart train refuses the
    experts split without it) and no zero-bubble schedule (not modelled with experts); context
    parallelism is planned (tests/test_plan_moe_ep_tp.py)."""
    assert megart_main(ARGV.split()) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = [c["layout"] for c in out["candidates"]]
    assert len(layouts) > 4 and any(lay["pp"] > 1 for lay in layouts)
    assert any(lay["tp"] == 1 for lay in layouts) and any(lay["tp"] > 1 for lay in layouts)
    assert all(lay["sequence_parallel"] for lay in layouts if lay["tp"] > 1)
    assert all(lay["schedule"] not in ("zb-h1", "zb-v") for lay in layouts)
    assert out["tflops_per_gpu"] >= out["model_tflops_per_gpu"] > 0


def test_the_cli_plans_moe_at_tensor_parallel_size_2_with_sequence_parallelism(capsys):
    """A given t = 2 with --sequence-parallel: every layout has them, its experts split (the
    parameters less than at t = 1 but more than half: the router, norms and embedding are
    whole on each rank or split alike), and its tensor-parallel time is counted."""
    one_stage = f"{ARGV} --pipeline-model-parallel-size 1"
    assert (
        megart_main(f"{one_stage} --tensor-model-parallel-size 2 --sequence-parallel".split()) == 0
    )
    two = json.loads(capsys.readouterr().out)["candidates"]
    assert two and all(c["layout"]["tp"] == 2 and c["layout"]["sequence_parallel"] for c in two)
    assert all(c["time_s"]["tp_comm"] > 0 for c in two)
    assert megart_main(f"{one_stage} --tensor-model-parallel-size 1".split()) == 0
    one = json.loads(capsys.readouterr().out)["candidates"]
    p1, p2 = one[0]["memory_gib"]["parameters"], two[0]["memory_gib"]["parameters"]
    assert p1 / 2 < p2 < p1


@pytest.mark.parametrize(
    "extra,says",
    [
        # megart train reads --sequence-parallel left out as off, and refuses it so.
        ("--tensor-model-parallel-size 2", "needs --sequence-parallel"),
        ("--recompute-activations --recompute-modules layernorm", "layernorm"),
        ("--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1", "zb-h1"),
        ("--runtime megatron", "--num-experts"),
    ],
    ids=["tp2-without-sp", "layernorm", "zero-bubble", "megatron-runtime"],
)
def test_the_cli_refuses_what_moe_cannot_run_or_is_not_modelled(extra, says, capsys):
    assert megart_main(f"{ARGV} {extra}".split()) == 2
    assert says in capsys.readouterr().err
