"""Shared experts (--moe-shared-expert-intermediate-size, models.moe; Megatron-Core's
SharedExpertMLP) and their gate (--moe-shared-expert-gate): the flags reach the model and its
names map both ways; runs at tp2 with sequence parallelism and at ep2 follow the one-process
curve (the ungated experts' Megatron-Core logits and gradients are tests/test_moe.py's MODELS,
GRADIENT_CASES and TP_CASES; the gated ones' are here: logits both ways, one step's gradients
at tp1 and at tp2 with sequence parallelism, and the gate left out, without its sigmoid or its
gradient not summed over the group caught); what other parts of megart cannot take yet is
refused by name."""

import argparse
import dataclasses

import pytest

import megatron_core_workers as mcw
import moe_tp_workers as mtw
import moe_workers as mw
import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPT, GPTConfig, hf_mixtral, hf_qwen3_moe
from megart.models.megatron_names import from_megatron, to_megatron
from megart.plan.flags import refuse_unmodelled
from train_workers import SAME_RUN

SHARED = ("--moe-shared-expert-intermediate-size", "24")
MOE = ("--num-experts", "4", "--disable-bias-linear", *SHARED)
TRAIN = dict(num_experts=4, disable_bias_linear=True, moe_aux_loss_coeff=0.1,
             moe_z_loss_coeff=0.01, moe_shared_expert_intermediate_size=24,
             train_iters=4)  # fmt: skip


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_flag_reaches_the_layers():
    cfg = parse(*MOE, "--swiglu").gpt_config()
    assert cfg.moe_shared_expert_intermediate_size == 24
    mlp = GPT(cfg).chunk.blocks[0].mlp
    assert mlp.shared_experts.fc.weight.shape == (24, cfg.hidden_size)
    assert mlp.shared_experts.proj.weight.shape == (cfg.hidden_size, 24)
    plain = parse("--num-experts", "4", "--disable-bias-linear").gpt_config()
    assert GPT(plain).chunk.blocks[0].mlp.shared_experts is None


def test_megatron_cores_names_both_ways():
    """megart's ``mlp.shared_experts.{gate,fc,proj}`` are Megatron-Core's
    ``mlp.shared_experts.linear_fc1`` ([gate; up]) and ``linear_fc2``."""
    cfg = parse(*MOE, "--swiglu").gpt_config()
    ours = GPT(cfg).chunk.state_dict()
    theirs = to_megatron(ours, cfg)
    fc1 = theirs["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    assert fc1.shape == (48, cfg.hidden_size)
    assert (fc1[:24] == ours["blocks.0.mlp.shared_experts.gate.weight"]).all()
    assert "decoder.layers.1.mlp.shared_experts.linear_fc2.weight" in theirs
    back = from_megatron(theirs, cfg)
    assert set(back) == set(ours)
    assert all((back[n] == ours[n]).all() for n in ours)


@pytest.fixture(scope="module")
def one_process():
    return launch(tw.train_kw, 1, TRAIN, timeout=300)[0]


# name: (processes, flags)
RUNS = {
    "tp2-sp": (2, dict(TRAIN, tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2": (2, dict(TRAIN, expert_model_parallel_size=2)),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_parallel_runs_follow_the_one_process_curve(one_process, name):
    """tp2: the shared experts split as the dense MLP (their input gathered from, their output
    reduce-scattered to, the sequence's slices); ep2: replicated, averaged over both ranks."""
    processes, kw = RUNS[name]
    want = [h["loss"] for h in one_process]
    got = launch(tw.train_kw, processes, kw, timeout=300)[0]
    assert [h["loss"] for h in got] == pytest.approx(want, **SAME_RUN)
    for logged in ("load_balancing_loss", "z_loss"):
        assert [h[logged] for h in got] == pytest.approx([h[logged] for h in one_process],
                                                         **SAME_RUN)  # fmt: skip


def test_the_shared_experts_are_in_the_curve(one_process):
    without = launch(tw.train_kw, 1, dict(TRAIN, moe_shared_expert_intermediate_size=None),
                     timeout=300)[0]  # fmt: skip
    assert [h["loss"] for h in without] != pytest.approx([h["loss"] for h in one_process],
                                                         rel=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (SHARED, 1, r"--moe-shared-expert-intermediate-size .*: mixture-of-experts settings, "
         "but the model has no experts"),
        ((*MOE[:-1], "0"), 1, "--moe-shared-expert-intermediate-size 0: give 1 or more"),
        ((*MOE[:-1], "15", "--tensor-model-parallel-size", "2", "--sequence-parallel"), 2,
         r"shared experts' MLP size 15 \(--moe-shared-expert-intermediate-size\) does not "
         "split over tensor-parallel size 2"),
    ],
)  # fmt: skip
def test_what_megart_cannot_run_is_refused_by_name(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).check(world)


def test_the_gate_flag_reaches_the_layers():
    """--moe-shared-expert-gate: one [1, h] weight per MoE layer, Megatron-Core's
    ``mlp.shared_experts.gate_weight``, replicated (no partition_dim), its gradient completed
    over the tensor-parallel group under sequence parallelism as the router's."""
    cfg = parse(*MOE, "--moe-shared-expert-gate").gpt_config()
    assert cfg.moe_shared_expert_gate
    gate = GPT(cfg).chunk.blocks[1].mlp.shared_expert_gate.weight
    assert gate.shape == (1, cfg.hidden_size) and not hasattr(gate, "partition_dim")
    ours = GPT(cfg).chunk.state_dict()
    theirs = to_megatron(ours, cfg)
    assert (theirs["decoder.layers.1.mlp.shared_experts.gate_weight"] ==
            ours["blocks.1.mlp.shared_expert_gate.weight"]).all()  # fmt: skip
    back = from_megatron(theirs, cfg)
    assert set(back) == set(ours) and all((back[n] == ours[n]).all() for n in ours)
    assert GPT(parse(*MOE).gpt_config()).chunk.blocks[0].mlp.shared_expert_gate is None


def test_a_gate_without_shared_experts_is_refused_by_name():
    with pytest.raises(ConfigError, match="--moe-shared-expert-gate gates the shared experts' "
                       "output, but there are none"):  # fmt: skip
        parse("--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-gate").check(1)
    said = r"--moe-shared-expert-gate .moe_shared_expert_gate=True\): mixture-of-experts settings"
    with pytest.raises(ConfigError, match=said + ", but the model has no experts"):
        parse("--moe-shared-expert-gate").check(1)


def test_megart_plan_models_shared_experts():
    """No longer refused: the plan counts their weights, a SwiGLU MLP of width 24 in each MoE
    layer, and the gate's [1, h] weight (every part against real ranks:
    tests/test_plan_moe_shared.py, tests/test_plan_moe_gate.py)."""
    from megart.cli.plan import main as plan_main
    from megart.plan.parameters import state_bytes

    refuse_unmodelled(parse(*MOE))  # raises nothing
    cfg = parse(*MOE, "--swiglu").gpt_config()
    plain = dataclasses.replace(cfg, moe_shared_expert_intermediate_size=None)
    added = (state_bytes(cfg, 1, 1, 0, 1, 1, False).parameters
             - state_bytes(plain, 1, 1, 0, 1, 1, False).parameters)  # fmt: skip
    assert added == cfg.num_layers * 3 * 24 * cfg.hidden_size * 4
    gated = dataclasses.replace(cfg, moe_shared_expert_gate=True)
    gate = (state_bytes(gated, 1, 1, 0, 1, 1, False).parameters
            - state_bytes(cfg, 1, 1, 0, 1, 1, False).parameters)  # fmt: skip
    assert gate == cfg.num_layers * cfg.hidden_size * 4
    argv = ["--gpu", "h100-80gb", "--num-gpus", "8", "--global-batch-size", "64", *MOE,
            "--moe-shared-expert-gate"]  # fmt: skip
    assert plan_main(argv) == 0


LLAMA = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
             ffn_hidden_size=48, normalization="rmsnorm", position_embedding="rotary",
             activation="swiglu", bias=False, num_experts=4,
             moe_shared_expert_intermediate_size=24)  # fmt: skip


@pytest.mark.parametrize(
    "fmt,kw", [(hf_mixtral, {}), (hf_qwen3_moe, dict(qk_layernorm=True))], ids=["mixtral", "qwen3"]
)
def test_hugging_face_writers_refuse_shared_experts_by_name(fmt, kw):
    cfg = GPTConfig(**LLAMA, **kw)
    with pytest.raises(ConfigError, match=r"--moe-shared-expert-intermediate-size 24 \(.* has "
                       "no shared experts\\)"):  # fmt: skip
        fmt.check(cfg)
    fmt.check(GPTConfig(**{**LLAMA, **kw, "moe_shared_expert_intermediate_size": None}))


def test_use_checkpoint_args_takes_the_shared_experts_from_a_megart_checkpoint(tmp_path):
    """As Megatron-LM's --use-checkpoint-args forces --moe-shared-expert-intermediate-size;
    without it, a run of other shared experts is refused naming the flag."""
    launch(tw.train_kw, 1, dict(TRAIN, train_iters=1, save=str(tmp_path)), timeout=300)
    got = parse("--load", str(tmp_path), "--use-checkpoint-args", *SHARED[:1], "8")
    assert got.moe_shared_expert_intermediate_size == 24
    assert got.gpt_config().moe_shared_expert_intermediate_size == 24
    other = dict(TRAIN, moe_shared_expert_intermediate_size=8, load=str(tmp_path))
    said = launch(mw.refusal, 1, other, timeout=300)[0]
    assert "--moe-shared-expert-intermediate-size 24" in said, said
    # The gate stays the command line's, as in Megatron-LM (which does not force it).
    gated = dict(TRAIN, moe_shared_expert_gate=True, load=str(tmp_path))
    said = launch(mw.refusal, 1, gated, timeout=300)[0]
    assert "--moe-shared-expert-gate" in said, said


def test_the_flops_count_the_shared_experts_as_megatron():
    """Megatron's formula: each MoE layer's MLP work is (moe_ffn x topk + S) wide."""
    from megart.training.flops import model_flops

    cfg = parse("--num-experts", "4", "--disable-bias-linear").gpt_config()
    shared = dataclasses.replace(
        cfg, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=32
    )
    wider = dataclasses.replace(cfg, moe_ffn_hidden_size=32)  # 2 x 32 = 2 x 16 + 32
    assert (
        model_flops(shared, 8)
        == model_flops(wider, 8)
        > model_flops(dataclasses.replace(shared, moe_shared_expert_intermediate_size=None), 8)
    )
    # Nor does the formula count the gate's product (as it leaves out the router's).
    gated = dataclasses.replace(shared, moe_shared_expert_gate=True)
    assert model_flops(gated, 8) == model_flops(shared, 8)


# Megatron-Core's MoE GPTModel with its shared experts' gate (float64, CPU, the local spec).
GATE_BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                 num_attention_heads=4, bias=False, num_experts=4,
                 moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True)  # fmt: skip
SWIGLU = dict(activation="swiglu", moe_shared_expert_intermediate_size=24)
GATED = {
    "gelu": {},
    "swiglu-dense-then-moe": {**SWIGLU, "moe_layer_freq": (0, 1)},
    "llama-style-sigmoid-router": {
        **LLAMA,
        "moe_shared_expert_intermediate_size": 24,
        "moe_router_score_function": "sigmoid",
    },
}


@pytest.fixture(scope="module")
def gated_logits():
    return mcw.compare_named(GATE_BASE, GATED)


@pytest.mark.parametrize("name", list(GATED))
def test_megatron_core_computes_the_gated_logits_both_ways(gated_logits, name):
    r = gated_logits[name]
    assert r["scale"] > 0.5
    assert r["forward"] < 1e-6  # megart's weights in Megatron-Core's model (its fp32 softmax)
    assert r["reverse"] < 1e-6  # Megatron-Core's own weights in megart's


LOSSES = dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
# (model, loss factor, megart's factor, megart's model changes[, expert biases' seed,
# microbatches, megart's gate mistake])
GATE_GRADIENTS = {
    "gelu": ({**GATE_BASE, **LOSSES}, 0.5, None, None, None),
    "swiglu": ({**GATE_BASE, **LOSSES, **SWIGLU}, 0.25, None, None, None),
    # The mistakes this exists to catch (moe_workers.gate_mistake).
    "gate-not-applied": ({**GATE_BASE, **LOSSES}, 0.5, None, None, None, 1, "gate-not-applied"),
    "gate-without-sigmoid": (
        {**GATE_BASE, **LOSSES},
        0.5,
        None,
        None,
        None,
        1,
        "gate-without-sigmoid",
    ),
}


def by_name(worker, processes: int, cases: dict) -> dict:
    """``worker`` run on ``processes`` launched ranks over the cases; rank 0's results by the
    cases' names."""
    results = launch(worker, processes, list(cases.values()), timeout=300)[0]
    return dict(zip(cases, results, strict=True))


@pytest.fixture(scope="module")
def gate_gradients():
    return by_name(mw.gradients_all, 1, GATE_GRADIENTS)


@pytest.mark.parametrize("name", [n for n, c in GATE_GRADIENTS.items() if c[-1] is None])
def test_a_gated_training_step_has_megatron_cores_gradients(gate_gradients, name):
    r = gate_gradients[name]
    assert r["top"] > 1e-3
    assert r["largest"] < 1e-6  # every parameter, relative to the largest gradient
    assert r["gate"] < 1e-6


@pytest.mark.parametrize("name", [n for n, c in GATE_GRADIENTS.items() if c[-1] is not None])
def test_the_comparison_catches_a_wrong_gate(gate_gradients, name):
    assert gate_gradients[name]["largest"] > 1e-3


# At tp2 with sequence parallelism, each side's own shards (moe_tp_workers.compare):
# (model, loss factor, megart's mistake or None).
GATE_TP = {
    "swiglu": ({**GATE_BASE, **LOSSES, **SWIGLU}, 0.5, None),
    "gelu-pre-softmax": ({**GATE_BASE, **LOSSES, "moe_router_pre_softmax": True}, 0.5, None),
    "gate-gradient-not-summed": ({**GATE_BASE, **LOSSES, **SWIGLU}, 0.5, "gate-unsummed"),
    "gate-without-sigmoid": ({**GATE_BASE, **LOSSES, **SWIGLU}, 0.5, "gate-without-sigmoid"),
}


@pytest.fixture(scope="module")
def gate_tp2():
    return by_name(mtw.compare_all, 2, GATE_TP)


@pytest.mark.parametrize("name", [n for n, c in GATE_TP.items() if c[2] is None])
def test_tensor_parallel_gated_shared_experts_are_megatron_cores(gate_tp2, name):
    """The gate applied to each rank's slice of the sequence, its weight replicated and its
    gradient summed over the group: Megatron-Core's logits and one step's gradients."""
    r = gate_tp2[name]
    assert r["scale"] > 0.5
    assert r["megatron_logits"] < 1e-6
    assert r["one_process_logits"] < 1e-12
    assert r["top"] > 1e-3
    assert r["largest"] < 1e-6
    assert r["gate"] < 1e-6


def test_the_tensor_parallel_comparison_catches_a_wrong_gate(gate_tp2):
    assert gate_tp2["gate-gradient-not-summed"]["gate"] > 1e-2
    wrong = gate_tp2["gate-without-sigmoid"]
    assert wrong["megatron_logits"] > 1e-3 and wrong["largest"] > 1e-3


GATED_TRAIN = dict(TRAIN, moe_shared_expert_gate=True)


def test_gated_runs_follow_the_one_process_curve_and_the_gate_is_in_it(one_process):
    """tp2 with sequence parallelism, ep2 (the gate replicated, averaged over both ranks) and
    pp2 follow the gated one-process run, which is not the ungated one."""
    gated = launch(tw.train_kw, 1, GATED_TRAIN, timeout=300)[0]
    want = [h["loss"] for h in gated]
    assert want[1:] != pytest.approx([h["loss"] for h in one_process][1:], rel=1e-4)
    for processes, kw in [*RUNS.values(), (2, dict(TRAIN, pipeline_model_parallel_size=2))]:
        got = launch(tw.train_kw, processes, dict(kw, moe_shared_expert_gate=True), timeout=300)
        assert [h["loss"] for h in got[-1]] == pytest.approx(want, **SAME_RUN), kw
