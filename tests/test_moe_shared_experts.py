"""Shared experts (--moe-shared-expert-intermediate-size, models.moe; Megatron-Core's
SharedExpertMLP without its gate): the flag reaches the model and its names map both ways;
runs at tp2 with sequence parallelism and at ep2 follow the one-process curve (Megatron-Core's
logits and gradients are tests/test_moe.py's MODELS, GRADIENT_CASES and TP_CASES); what other
parts of megart cannot take yet is refused by name."""

import argparse
import dataclasses

import pytest

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
        ((*MOE, "--ckpt-format", "torch"), 1,
         "--moe-shared-expert-intermediate-size 24 with --ckpt-format torch: megart does not"),
        ((*MOE, "--ckpt-format", "torch_dist"), 1, "with --ckpt-format torch_dist: megart"),
    ],
)  # fmt: skip
def test_what_megart_cannot_run_is_refused_by_name(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).check(world)


def test_megatrons_gate_is_refused_by_name(capsys):
    from megart.cli.train import main

    assert main([*MOE, "--moe-shared-expert-gate"]) != 0
    assert "--moe-shared-expert-gate: megart's mixture-of-experts" in capsys.readouterr().err


def test_megart_plan_models_shared_experts():
    """No longer refused: the plan counts their weights, a SwiGLU MLP of width 24 in each MoE
    layer (every part against real ranks: tests/test_plan_moe_shared.py); the gate stays
    refused by name, as megart train refuses it."""
    from megart.cli.plan import main as plan_main
    from megart.plan.parameters import state_bytes

    refuse_unmodelled(parse(*MOE))  # raises nothing
    cfg = parse(*MOE, "--swiglu").gpt_config()
    plain = dataclasses.replace(cfg, moe_shared_expert_intermediate_size=None)
    added = (state_bytes(cfg, 1, 1, 0, 1, 1, False).parameters
             - state_bytes(plain, 1, 1, 0, 1, 1, False).parameters)  # fmt: skip
    assert added == cfg.num_layers * 3 * 24 * cfg.hidden_size * 4
    argv = ["--gpu", "h100-80gb", "--num-gpus", "8", "--global-batch-size", "64", *MOE,
            "--moe-shared-expert-gate"]  # fmt: skip
    assert plan_main(argv) == 2


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
