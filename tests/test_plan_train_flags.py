"""megart plan takes megart train's whole command line: every flag is classified
(megart.plan.flags), a training command plans as its model and layout flags alone do, the flags
the planner does not model are refused by name (and accepted at their defaults), and
--use-checkpoint-args reads the model from a checkpoint as megart train does."""

import argparse
import dataclasses
import json
import re

import pytest

import megatron_workers as mw
from megart.cli.plan import _parser
from megart.cli.plan import main as plan_main
from megart.cli.train import add_arguments
from megart.launcher import launch
from megart.plan import flags
from megart.training.config import TrainConfig

CLUSTER = ["--gpu", "a100-80gb", "--num-gpus", "64"]
MODEL = [
    "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--seq-length", "2048", "--vocab-size", "50257", "--global-batch-size", "256",
]  # fmt: skip


def plan(capsys, *argv: str) -> tuple[int, dict | str]:
    code = plan_main([*CLUSTER, "--json", "--top", "3", *argv])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else out.err


def test_every_train_config_field_is_classified_once():
    """A field added to TrainConfig fails here until someone decides what the plan does with
    it."""
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    groups = [flags.LAYOUT, flags.MODELLED, tuple(flags.UNMODELLED), flags.NO_EFFECT]
    classified = [n for group in groups for n in group]
    assert sorted(classified) == sorted(names)  # each once: no duplicates, none missing
    for name, (alike, _) in flags.UNMODELLED.items():
        assert getattr(TrainConfig(), name) in alike, name  # the default always plans


def test_every_train_flag_is_a_plan_flag():
    train = argparse.ArgumentParser()
    add_arguments(train)
    plan = _parser()._option_string_actions
    for action in train._actions:
        for spelling in set(action.option_strings) - {"-h", "--help"}:
            assert plan[spelling].dest == action.dest, spelling  # the same field, not another


def test_a_training_command_line_plans_as_its_model_and_layout_flags(capsys):
    """Megatron's GPT-3 example's flags that change no iteration's time or memory (schedule,
    data, checkpoints, logging, evaluation, Megatron's aliases) leave the prediction as it is."""
    # fmt: off
    train = [
        "--max-position-embeddings", "2048", "--attention-backend", "auto",
        "--train-samples", "146484375",
        "--lr-decay-samples", "126953125", "--lr-warmup-samples", "183105",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-5",
        "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--data-path", "/no/such/corpus",
        "--split", "949,50,1", "--log-interval", "100", "--save-interval", "10000",
        "--eval-interval", "1000", "--save", "/no/such/ckpt", "--load", "/no/such/ckpt",
        "--eval-iters", "10", "--tensorboard-dir", "/no/such/tb", "--seed", "7",
        "--no-masked-softmax-fusion", "--use-flash-attn", "--transformer-impl", "local",
        "--use-mcore-models", "--distributed-backend", "nccl", "--use-dist-ckpt",
    ]
    # fmt: on
    code, alone = plan(capsys, *MODEL, "--fp16")
    assert code == 0, alone
    code, whole = plan(capsys, *MODEL, "--fp16", *train)
    assert code == 0, whole
    assert whole == alone
    # The layout flags of a command are kept, not searched.
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    code, fixed = plan(capsys, *MODEL, *layout, *train)
    assert code == 0, fixed
    assert {(c["layout"]["tp"], c["layout"]["pp"]) for c in fixed["candidates"]} == {(2, 2)}


def test_a_batch_ramp_up_keeps_the_layouts_megart_train_would_run_it_on(capsys):
    """--rampup-batch-size 16 16 N: megart train refuses a layout whose micro-batch times
    data-parallel size does not divide the ramp's batches, so the plan leaves those out and
    plans the full batch's iteration."""
    code, ramp = plan(capsys, *MODEL, "--rampup-batch-size", "16", "16", "5859375")
    assert code == 0, ramp
    code, alone = plan(capsys, *MODEL)
    assert code == 0, alone
    assert alone["layout"]["dp"] * alone["layout"]["micro_batch"] > 16  # the ramp matters here
    for c in ramp["candidates"]:
        assert 16 % (c["layout"]["dp"] * c["layout"]["micro_batch"]) == 0, c["layout"]


# A value other than megart train's default, spelt as megart train takes it.
UNMODELLED_GIVEN = {
    "attention_backend": ["--attention-backend", "unfused"],
    "reset_attention_mask": ["--reset-attention-mask"],
    "bias_gelu_fusion": ["--no-bias-gelu-fusion"],
    "gradient_accumulation_fusion": ["--no-gradient-accumulation-fusion"],
    "fused_layer_norm": ["--fused-layer-norm"],
    "log_params_norm": ["--log-params-norm"],
    "log_num_zeros_in_grad": ["--log-num-zeros-in-grad"],
    "timing_log_level": ["--timing-log-level", "1"],
    "empty_unused_memory_level": ["--empty-unused-memory-level", "1"],
    "moe_expert_capacity_factor": ["--num-experts", "8", "--disable-bias-linear",
                                   "--moe-expert-capacity-factor", "1.0"],
    "moe_token_drop_policy": ["--num-experts", "8", "--disable-bias-linear",
                              "--moe-expert-capacity-factor", "1.0",
                              "--moe-token-drop-policy", "position"],
    "moe_pad_expert_input_to_capacity": ["--num-experts", "8", "--disable-bias-linear",
                                         "--moe-expert-capacity-factor", "1.0",
                                         "--moe-pad-expert-input-to-capacity"],
    "moe_input_jitter_eps": ["--num-experts", "8", "--disable-bias-linear",
                             "--moe-input-jitter-eps", "0.01"],
    "quick_geglu": ["--quick-geglu", "--disable-bias-linear"],
    "glu_linear_offset": ["--quick-geglu", "--disable-bias-linear", "--glu-linear-offset", "1"],
    "activation_func_clamp_value": ["--quick-geglu", "--disable-bias-linear",
                                    "--activation-func-clamp-value", "7"],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(flags.UNMODELLED))
def test_a_flag_the_plan_does_not_model_is_refused_by_name(name, capsys):
    code, err = plan(capsys, *MODEL, *UNMODELLED_GIVEN[name])
    assert code == 2
    refused = err.split("megart plan does not model ", 1)[1]
    assert re.search(rf"(^|; )--(no-)?{name.replace('_', '-')}\b", refused), err
    assert "out to plan megart train's default" in err and err.count("\n") == 1  # one line


def test_a_head_size_other_than_h_over_heads_is_planned_for_megarts_runtime(capsys):
    """--kv-channels 128 is 2048 / 16, the same heads; 64 makes the query heads half as wide,
    which the plan models (tests/test_plan_memory*.py) but not for Megatron-LM's runtime."""
    fixed = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--micro-batch-size", "1"]  # fmt: skip
    usual = plan(capsys, *MODEL, *fixed)[1]
    same = plan(capsys, *MODEL, *fixed, "--kv-channels", "128")[1]
    assert same["memory_gib"] == usual["memory_gib"]
    narrow = plan(capsys, *MODEL, *fixed, "--kv-channels", "64")[1]
    for part in ("parameters", "activations"):
        assert narrow["memory_gib"][part] < usual["memory_gib"][part], part
    assert narrow["iteration_time_s"] < usual["iteration_time_s"]
    code, err = plan(capsys, *MODEL, "--kv-channels", "64", "--runtime", "megatron")
    assert code == 2 and "megart plan does not model --kv-channels 64 (heads other" in err


def test_unmodelled_flags_at_their_default_values_plan_as_left_out(capsys):
    code, alone = plan(capsys, *MODEL)
    assert code == 0, alone
    defaults = [
        "--overlap-grad-reduce", "--attention-backend", "flash", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--bias-gelu-fusion",
    ]  # fmt: skip
    code, same = plan(capsys, *MODEL, *defaults)
    assert code == 0, same
    assert same == alone


def test_recompute_activations_plans_as_selective_recomputation(capsys):
    code, switch = plan(capsys, *MODEL, "--recompute-activations")
    assert code == 0, switch
    code, granularity = plan(capsys, *MODEL, "--recompute-granularity", "selective")
    assert code == 0, granularity
    assert switch == granularity
    assert {c["layout"]["recompute"] for c in switch["candidates"]} == {"selective"}
    # Whatever --recompute-granularity says, as Megatron-LM's validate_args sets it (the plan
    # fuzz found the plan recommending full there, which megart train then refused).
    code, both = plan(capsys, *MODEL, "--recompute-activations", "--recompute-granularity", "full")
    assert code == 0 and both == switch, both
    config = TrainConfig(recompute_activations=True, recompute_granularity="full")
    assert config.gpt_config().recompute_granularity == "selective"


def test_recompute_modules_plan_what_each_drops_and_replays(capsys):
    """--recompute-modules: on one layout, layernorm and mlp each hold less than Megatron's
    default, all three less still; mlp's replay takes longer and its FLOPs count in TFLOP/s;
    Megatron's default given is the flag left out. Refused as megart train refuses it (without
    selective recomputation, MoE's modules), and under --runtime megatron unless core_attn."""
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--micro-batch-size", "1", "--sequence-parallel", "--use-distributed-optimizer",
              "--recompute-granularity", "selective"]  # fmt: skip

    def pick(*modules: str) -> dict:
        code, out = plan(
            capsys, *MODEL, *layout, *(("--recompute-modules", *modules) * bool(modules))
        )
        assert code == 0, out
        return out

    default, core = pick(), pick("core_attn")
    assert core == default
    gib = {m: pick(*m.split())["memory_gib"]["activations"]
           for m in ("core_attn", "layernorm", "mlp", "core_attn layernorm mlp")}  # fmt: skip
    assert gib["core_attn layernorm mlp"] < min(gib["layernorm"], gib["mlp"]) < gib["core_attn"]
    mlp = pick("core_attn", "mlp")
    assert mlp["time_s"]["iteration"] > default["time_s"]["iteration"]
    flops = mlp["tflops_per_gpu"] * mlp["time_s"]["iteration"]
    assert flops > default["tflops_per_gpu"] * default["time_s"]["iteration"]
    for argv, said in [
        (["--recompute-modules", "mlp"], "--recompute-modules mlp without recomputation"),
        ([*layout, "--recompute-modules", "moe_act"], "--recompute-modules moe_act (Megatron-LM "
         "recomputes the experts' activation only with --moe-grouped-gemm"),
        ([*layout, "--recompute-modules", "mlp", "--runtime", "megatron"],
         "--recompute-modules mlp (Megatron-LM's selective count is the attention core's"),
    ]:  # fmt: skip
        code, err = plan(capsys, *MODEL, *argv)
        assert code == 2 and said in err, err


def test_use_checkpoint_args_plans_the_checkpoints_model(tmp_path, capsys):
    """megart plan --use-checkpoint-args --load DIR takes the model megart train saved there,
    as megart train would resume it."""
    ckpt = tmp_path / "ckpt"
    saved = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--position-embedding-type", "rope", "--swiglu",
        "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "1",
        "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
    ]  # fmt: skip
    for status, out in launch(mw.run_cli, 2, saved, timeout=300):
        assert status == 0, out
    model = saved[: saved.index("--micro-batch-size")]
    batch = ["--global-batch-size", "64"]
    code, direct = plan(capsys, *model, "--vocab-size", "256", *batch)
    assert code == 0, direct
    code, loaded = plan(capsys, "--use-checkpoint-args", "--load", str(ckpt), *batch)
    assert code == 0, loaded
    assert loaded == direct
    code, other = plan(capsys, "--num-layers", "2", "--hidden-size", "64", *batch)
    assert code == 0 and other != direct  # the checkpoint's architecture mattered
    # The layout is searched unless --use-mp-args-from-checkpoint-args takes the checkpoint's.
    both = ["--use-checkpoint-args", "--load", str(ckpt), *batch, "--top", "20"]
    code, searched = plan(capsys, *both)
    assert code == 0, searched
    code, kept = plan(capsys, *both, "--use-mp-args-from-checkpoint-args")
    assert code == 0, kept

    def layouts(out: dict) -> set:
        return {(c["layout"]["tp"], c["layout"]["pp"], c["layout"]["chunks"])
                for c in out["candidates"]}  # fmt: skip

    assert layouts(kept) == {(1, 2, 1)} != layouts(searched)


def test_pipeline_messages_without_scatter_gather_take_longer():
    """--no-scatter-gather-tensors-in-pipeline: each rank sends the whole b s h (megart
    train's trainer_setup), so at t8 p8 the pipeline's messages take longer; with
    --sequence-parallel the messages are the rank's s/t tokens either way."""
    from megart.plan.estimate import estimate
    from megart.plan.hardware import load_profile
    from megart.plan.layout import Layout

    model = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                 vocab_size=50257, global_batch_size=256, bf16=True)  # fmt: skip
    times = {}
    for sp in (False, True):
        layout = Layout(8, 8, 1, 1, 1, sp, None, False, None, None, None, 1)
        for scatter in (False, True):
            config = TrainConfig(**model, scatter_gather_tensors_in_pipeline=scatter)
            e = estimate(config, layout, load_profile("a100-80gb"))
            times[sp, scatter] = e.iteration_time
    assert times[False, False] > times[False, True]
    assert times[True, False] == times[True, True]


LONG = [
    "--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--seq-length", "32768", "--vocab-size", "32000", "--global-batch-size", "8",
    "--window-size", "4095,0",
]  # fmt: skip


def test_a_window_plans_context_parallelism_under_every_exchange(capsys):
    """A window under the ring (p2p: its pieces inside the window, plan.ring_window_cost), the
    all-to-all (the query tiles over each rank's heads) and the all-gather: a given C > 1
    planned; C searched, and C > 1 among the 50 best under the ring and the all-to-all."""
    for comm in ("p2p", "a2a", "all_gather"):
        code, searched = plan(capsys, *LONG, "--cp-comm-type", comm, "--top", "50")
        assert code == 0, searched
        cps = {c["layout"]["cp"] for c in searched["candidates"]}
        assert cps - {1} if comm != "all_gather" else cps, (comm, cps)
        code, given = plan(capsys, *LONG, "--cp-comm-type", comm, "--context-parallel-size", "2")
        assert code == 0, given
        assert {c["layout"]["cp"] for c in given["candidates"]} == {2}


def test_data_parallel_flags_reach_the_plan_from_the_command_line(capsys):
    """The flags plan.data_parallel models, given on the command line: --grad-reduce-in-bf16
    adds each bucket's bf16 copy (half the fp32 gradients) to the gradients' memory, and
    --no-overlap-grad-reduce leaves the whole reduction exposed (never faster). --bf16 as
    megart train needs it with --grad-reduce-in-bf16 (the plan's bf16 when left out)."""
    layout = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--micro-batch-size", "1"]  # fmt: skip
    runs = {}
    for name, given in {"default": [], "bf16 reduce": ["--bf16", "--grad-reduce-in-bf16"],
                        "no overlap": ["--no-overlap-grad-reduce"]}.items():  # fmt: skip
        code, out = plan(capsys, *MODEL, *layout, *given)
        assert code == 0, out
        runs[name] = out
    grads = {n: r["memory_gib"]["gradients"] for n, r in runs.items()}
    assert grads["bf16 reduce"] == pytest.approx(1.5 * grads["default"])
    exposed = {n: r["time_s"]["dp_comm"] for n, r in runs.items()}
    assert exposed["no overlap"] > exposed["default"]
    assert exposed["bf16 reduce"] < exposed["default"]


@pytest.mark.parametrize("name", flags.MEGART_RUNTIME_ONLY)
def test_flags_modelled_for_megarts_runtime_only_are_refused_under_megatrons(name, capsys):
    """--runtime megatron predicts with Megatron-LM's conventions, which these flags' terms
    are not written for: refused by name there rather than predicted as if left out."""
    given = {
        "window_size": ["--window-size", "255,0"],
        "window_attn_skip_freq": ["--window-size", "255,0", "--window-attn-skip-freq", "2"],
        "overlap_grad_reduce": ["--no-overlap-grad-reduce"],
        "ddp_bucket_size": ["--ddp-bucket-size", "1000000"],
        "ddp_num_buckets": ["--ddp-num-buckets", "4"],
        "grad_reduce_in_bf16": ["--grad-reduce-in-bf16", "--bf16"],
        "cross_entropy_loss_fusion": ["--cross-entropy-loss-fusion"],
        "reset_attention_mask": ["--reset-attention-mask", "--tokenizer-type", "NullTokenizer"],
        "num_experts": ["--num-experts", "4", "--disable-bias-linear"],
        "multi_latent_attention": [
            "--multi-latent-attention",
            "--rope-type",
            "rope",
            "--position-embedding-type",
            "rope",
        ],
        "mtp_num_layers": ["--mtp-num-layers", "1"],
        "softmax_type": ["--softmax-type", "learnable"],
    }[name]
    code, out = plan(capsys, *MODEL, *given)
    assert code == 0, out
    code, err = plan(capsys, *MODEL, *given, "--runtime", "megatron")
    assert code == 2 and "with --runtime megatron" in err, err
    assert re.search(rf"--(no-)?{name.replace('_', '-')}\b", err), err
