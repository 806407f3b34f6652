"""megart plan with mixture-of-experts layers (plan.moe_memory, plan.moe_time, plan.parameters):
parameter, gradient and optimizer bytes against real megart train ranks exactly, and the
activations autograd saves at the peak (torch's saved-tensor hooks) exactly in fp32, where the
routing decides which expert gets which token but not the bytes (every expert term is per
token an expert got, k T in all). Under bf16 the dense layers' known CPU differences remain
(tests/test_plan_memory.py's doc; the same bytes as a dense model of these sizes): within 1%.
And the CLI: --num-experts plans layouts megart train runs (t = 1, no context parallelism, no
zero-bubble schedule) and refuses what it does not model."""

from __future__ import annotations

import json

import pytest

from megart.cli.main import main as megart_main
from plan_memory_check import SMALL, predicted_and_held

MOE = dict(SMALL, num_experts=4, moe_ffn_hidden_size=48, disable_bias_linear=True)

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
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,kw,exact", CASES, ids=[c[0] for c in CASES])
def test_predicted_moe_bytes_are_what_a_rank_holds(name, nproc, kw, exact):
    for held, want, cpu in predicted_and_held(nproc, kw):
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])
        if exact:
            assert held["saved_peak"] == want["saved"] + cpu, (name, held, want)
        else:
            assert held["saved_peak"] == pytest.approx(want["saved"] + cpu, rel=0.01)
        assert held["saved_after"] == 0


ARGV = (
    "plan --gpu h100-80gb --num-gpus 8 --num-layers 8 --hidden-size 1024 "
    "--num-attention-heads 16 --seq-length 2048 --global-batch-size 64 "
    "--num-experts 8 --disable-bias-linear --json --top 200"
)


def test_the_cli_plans_moe_at_tensor_parallel_size_1(capsys):
    """Every candidate megart plan shows for an MoE model is one megart train runs with it and
    the plan models: t = 1 (tensor-parallel experts are not modelled) and no context
    parallelism (megart train refuses it with experts), and no zero-bubble schedule (not
    modelled with experts)."""
    assert megart_main(ARGV.split()) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = [c["layout"] for c in out["candidates"]]
    assert len(layouts) > 4 and any(lay["pp"] > 1 for lay in layouts)
    assert all(lay["tp"] == 1 and lay["cp"] == 1 for lay in layouts)
    assert all(lay["schedule"] not in ("zb-h1", "zb-v") for lay in layouts)
    assert out["tflops_per_gpu"] >= out["model_tflops_per_gpu"] > 0


@pytest.mark.parametrize(
    "extra,says",
    [
        # megart train runs it (with sequence parallelism); the plan does not model it.
        (
            "--tensor-model-parallel-size 2 --sequence-parallel",
            "does not model --tensor-model-parallel-size 2 with --num-experts",
        ),
        ("--context-parallel-size 2", "--num-experts"),
        ("--recompute-activations --recompute-modules layernorm", "layernorm"),
        ("--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1", "zb-h1"),
        ("--runtime megatron", "--num-experts"),
    ],
    ids=["tp2", "cp2", "layernorm", "zero-bubble", "megatron-runtime"],
)
def test_the_cli_refuses_what_moe_cannot_run_or_is_not_modelled(extra, says, capsys):
    assert megart_main(f"{ARGV} {extra}".split()) == 2
    assert says in capsys.readouterr().err
