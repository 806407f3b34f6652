"""Mixture of experts (megart.models.moe; Megatron's --num-experts and --moe-* router flags)
against Megatron-Core 0.16.1's own MoE GPTModel (local spec, SequentialMLP experts, CPU,
float64): its logits from megart's weights and megart's from its own, and the gradients of a
training step with the load-balancing loss and the z-loss under a pipeline run's loss factor;
the same at tensor-parallel size 2 with sequence parallelism, each side's own shards (and the
legacy checkpoint of tp2 experts loaded by Megatron-Core). Then megart's runs: flags reach
the model, what cannot run is refused by name, pipeline, data-parallel, tensor-parallel and
context-parallel runs follow the one-process curve (and the curve catches the auxiliary losses
wrongly weighed under cp), and a checkpoint resumes on the curve, at another tensor-parallel
size too (recomputation: test_moe_recompute.py).

Megatron-Core's softmax over experts rounds to fp32 even in a float64 model (its
torch.softmax(..., dtype=torch.float32)); megart's keeps the logits' dtype from fp32 up, so the
two agree to some 1e-7 of logits near 2, not 1e-12 (the sigmoid rows, without that softmax,
agree to 1e-15)."""

import argparse

import pytest

import megatron_core_workers as mcw
import moe_tp_workers as mtw
import moe_workers as mw
import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from moe_ep_workers import MODEL, TRAIN
from train_workers import SAME_RUN

BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            bias=False, num_experts=4)  # fmt: skip
LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             untie_embeddings_and_output_weights=True, num_query_groups=2)  # fmt: skip
SHARED = dict(moe_shared_expert_intermediate_size=40)
SWIGLU_SHARED = dict(activation="swiglu", moe_shared_expert_intermediate_size=24)
MODELS = {
    "gelu-top2": {},
    "swiglu-pre-softmax-narrow-experts": dict(
        activation="swiglu", moe_router_pre_softmax=True, moe_ffn_hidden_size=24
    ),
    # Every second layer dense (Megatron-Core's decoder block spec takes the pattern).
    "top1-dense-then-moe": dict(
        num_experts=3, moe_router_topk=1, moe_router_pre_softmax=True, moe_layer_freq=(0, 1)
    ),
    "sigmoid-scaled-fp32-router": dict(
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.5,
        moe_router_dtype="fp32",
    ),
    "every-second-of-4": dict(num_layers=4, moe_layer_freq=2),
    "llama-style-top3-of-8": {**LLAMA, "num_experts": 8, "moe_router_topk": 3},
    # Shared experts (Megatron-Core's SharedExpertMLP, ungated): an MLP added to the experts'.
    "shared-experts": SHARED,
    "swiglu-shared-experts-dense-then-moe": {**SWIGLU_SHARED, "moe_layer_freq": (0, 1)},
}


@pytest.fixture(scope="module")
def logits():
    configs = [{**BASE, **kw} for kw in MODELS.values()]
    return dict(zip(MODELS, launch(mcw.compare_all, 1, configs, True, timeout=300)[0], strict=True))


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_computes_megarts_logits_both_ways(logits, name):
    r = logits[name]
    assert r["scale"] > 0.5  # logits of some size: routing reaches them
    assert r["forward"] < 1e-6  # megart's weights in Megatron-Core's MoE GPTModel
    assert r["reverse"] < 1e-6  # Megatron-Core's weights in megart's GPT


LOSSES = dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
GRADIENT_CASES = {
    # (model, the loss factor both use, megart's factor, megart's model changes)
    "aux-and-z-loss-half": ({**BASE, **LOSSES}, 0.5, None, None),
    "no-auxiliary-losses": (BASE, 0.5, None, None),
    "swiglu-pre-softmax-quarter": (
        {**BASE, "activation": "swiglu", "moe_router_pre_softmax": True, **LOSSES},
        0.25,
        None,
        None,
    ),
    "sigmoid": ({**BASE, "moe_router_score_function": "sigmoid", **LOSSES}, 0.5, None, None),
    "shared-experts": ({**BASE, **LOSSES, **SHARED}, 0.5, None, None),
    "swiglu-shared-experts": ({**BASE, **LOSSES, **SWIGLU_SHARED}, 0.5, None, None),
    # The mistakes this exists to catch: the losses' gradients not scaled as the loss is, and
    # the load-balancing loss weighed wrongly.
    "wrong-factor": ({**BASE, **LOSSES}, 0.5, 1.0, None),
    "wrong-coefficient": ({**BASE, **LOSSES}, 0.5, None, dict(moe_aux_loss_coeff=0.2)),
}


@pytest.fixture(scope="module")
def gradients():
    cases = list(GRADIENT_CASES.values())
    results = launch(mw.gradients_all, 1, cases, timeout=300)[0]
    return dict(zip(GRADIENT_CASES, results, strict=True))


@pytest.mark.parametrize("name", [n for n in GRADIENT_CASES if not n.startswith("wrong")])
def test_a_training_step_has_megatron_cores_gradients(gradients, name):
    r = gradients[name]
    assert r["top"] > 1e-3
    assert r["largest"] < 1e-6  # every parameter, relative to the largest gradient
    assert r["router"] < 1e-6
    # What each logs: its tracker's per-layer losses and megart's (models.moe.AuxLossScale).
    for logged, (ours, theirs) in r["logged"].items():
        assert sum(theirs) > 0.1 and ours == pytest.approx(theirs, rel=1e-6), logged


@pytest.mark.parametrize("name", ["wrong-factor", "wrong-coefficient"])
def test_the_comparison_catches_wrongly_scaled_auxiliary_losses(gradients, name):
    assert gradients[name]["router"] > 1e-3


# Tensor parallelism 2 with sequence parallelism (Megatron-Core's --sequence-parallel too):
# (model, loss factor, megart's deliberate mistake or None; see moe_tp_workers.compare).
TP_CASES = {
    "aux-and-z-loss": ({**BASE, **LOSSES}, 0.5, None),
    "swiglu-pre-softmax-narrow": (
        {**BASE, **LOSSES, "activation": "swiglu", "moe_router_pre_softmax": True,
         "moe_ffn_hidden_size": 24}, 0.25, None),
    "sigmoid-top3-of-8": (
        {**BASE, **LOSSES, "num_experts": 8, "moe_router_topk": 3,
         "moe_router_score_function": "sigmoid"}, 0.5, None),
    "dense-then-moe": ({**BASE, **LOSSES, "moe_layer_freq": (0, 1)}, 0.5, None),
    "swiglu-shared-experts": ({**BASE, **LOSSES, **SWIGLU_SHARED}, 0.5, None),
    # The mistakes this exists to catch.
    "aux-loss-counts-not-summed": ({**BASE, **LOSSES}, 0.5, "aux-local"),
    "router-gradient-not-summed": ({**BASE, **LOSSES}, 0.5, "router-unsummed"),
    "z-loss-not-divided": ({**BASE, **LOSSES}, 0.5, "z-undivided"),
}  # fmt: skip


@pytest.fixture(scope="module")
def tp2():
    results = launch(mtw.compare_all, 2, list(TP_CASES.values()), timeout=300)[0]
    return dict(zip(TP_CASES, results, strict=True))


@pytest.mark.parametrize("name", [n for n, c in TP_CASES.items() if c[2] is None])
def test_tensor_parallel_experts_are_megatron_cores(tp2, name):
    """megart's tp2 shards and Megatron-Core's tp2 shards of the same weights: the same
    logits (and megart's one process's), and one training step's gradients, the router's
    included, with the load-balancing loss and the z-loss."""
    r = tp2[name]
    assert r["scale"] > 0.5
    assert r["megatron_logits"] < 1e-6  # its softmax over experts rounds to fp32
    assert r["one_process_logits"] < 1e-12
    assert r["top"] > 1e-3
    assert r["largest"] < 1e-6
    assert r["router"] < 1e-6


@pytest.mark.parametrize("name", [n for n, c in TP_CASES.items() if c[2] is not None])
def test_the_tensor_parallel_comparison_catches_a_missing_sum_over_ranks(tp2, name):
    assert tp2[name]["router"] > 1e-2


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_flags_reach_the_model():
    cfg = parse(
        "--num-experts", "8", "--disable-bias-linear", "--moe-ffn-hidden-size", "48",
        "--moe-layer-freq", "([0]+[1]*1)*2", "--moe-router-topk", "1",
        "--moe-router-pre-softmax", "--moe-router-score-function", "softmax",
        "--moe-router-topk-scaling-factor", "1.5", "--moe-router-dtype", "fp32",
        "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
    ).gpt_config()  # fmt: skip
    assert (cfg.num_experts, cfg.moe_ffn_size, cfg.moe_layer_freq) == (8, 48, (0, 1, 0, 1))
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (cfg.moe_router_topk, cfg.moe_router_pre_softmax) == (1, True)
    assert (cfg.moe_router_topk_scaling_factor, cfg.moe_router_dtype) == (1.5, "fp32")
    assert (cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff) == (0.01, 0.001)
    assert parse("--num-experts", "0").gpt_config().num_experts is None  # Megatron's "none"
    every = parse("--num-experts", "2", "--disable-bias-linear", "--moe-layer-freq", "3")
    assert [every.gpt_config().is_moe_layer(i) for i in range(4)] == [True, False, False, True]


MOE = ("--num-experts", "4", "--disable-bias-linear")


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (("--num-experts", "4"), 1, "add --disable-bias-linear"),
        ((*MOE, "--tensor-model-parallel-size", "2"), 2, "needs --sequence-parallel"),
        ((*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--moe-ffn-hidden-size", "15"), 2, "experts' MLP size 15 .* tensor-parallel size 2"),
        (("--moe-aux-loss-coeff", "0.01"), 1, "the model has no experts"),
        ((*MOE, "--moe-router-topk", "1"), 1, "add --moe-router-pre-softmax"),
        ((*MOE, "--moe-router-topk", "5"), 1, "between 1 and --num-experts 4"),
        ((*MOE, "--moe-router-load-balancing-type", "sinkhorn"), 1, "sinkhorn .* not built"),
        ((*MOE, "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.1"), 1,
         "does not compute"),
        ((*MOE, "--moe-layer-freq", "[1,0,1]"), 1, "one 0 .dense. or 1 .MoE. per layer, 4"),
        ((*MOE, "--moe-layer-freq", "every"), 1, "--moe-layer-freq every: give an integer"),
        ((*MOE, "--recompute-granularity", "selective", "--recompute-modules", "layernorm"), 1,
         "layernorm with --num-experts"),
    ],
)  # fmt: skip
def test_what_megart_cannot_run_is_refused_by_name(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).check(world)


def test_megatrons_other_moe_flags_are_refused_by_name(capsys):
    from megart.cli.train import main

    assert main([*MOE, "--moe-enable-deepep", "--moe-shared-expert-overlap"]) != 0
    err = capsys.readouterr().err
    assert "--moe-enable-deepep: megart's mixture-of-experts layers" in err
    assert "--moe-shared-expert-overlap: megart's mixture-of-experts" in err


@pytest.fixture(scope="module")
def curves(moe_one_process):
    one = moe_one_process
    pp2 = launch(tw.train_kw, 2, dict(TRAIN, pipeline_model_parallel_size=2), timeout=300)[-1]
    interleaved = launch(tw.train_kw, 2, dict(TRAIN, pipeline_model_parallel_size=2,
                         num_layers_per_virtual_pipeline_stage=1), timeout=300)[-1]  # fmt: skip
    dp2 = launch(tw.train_kw, 2, TRAIN, timeout=300)[0]
    # Zero-bubble's V: the experts' weight gradients deferred to its W steps.
    zbv = launch(tw.train_kw, 2, dict(TRAIN, pipeline_model_parallel_size=2,
                 pipeline_schedule="zb-v"), timeout=300)[0]  # fmt: skip
    plain = launch(tw.train_kw, 1, dict(TRAIN, moe_aux_loss_coeff=0.0), timeout=300)[0]
    tp2 = launch(tw.train_kw, 2, dict(TRAIN, **TP2), timeout=300)[0]
    return one, pp2, interleaved, dp2, zbv, plain, tp2


TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)


def test_pipeline_and_data_parallel_runs_follow_the_one_process_curve(curves):
    """Each microbatch's auxiliary losses weigh 1/m of the batch on every layout (the engine's
    factor), so pp2 (1F1B, interleaved, zero-bubble V) and dp2 are the one-process run; so is
    tp2 with sequence parallelism, its ranks' auxiliary losses adding up to the sequence's."""
    one, pp2, interleaved, dp2, zbv, plain, tp2 = curves
    want = [h["loss"] for h in one]
    assert [h["loss"] for h in tp2] == pytest.approx(want, **SAME_RUN)
    assert [h["loss"] for h in pp2] == pytest.approx(want, **SAME_RUN)
    assert [h["loss"] for h in zbv] == pytest.approx(want, **SAME_RUN)
    assert [h["loss"] for h in interleaved] == pytest.approx(want, **SAME_RUN)
    assert [h["loss"] for h in dp2] == pytest.approx(want, **SAME_RUN)
    # The load-balancing loss is in the curve (the reported loss is the language model's).
    assert [h["loss"] for h in plain][1:] != pytest.approx(want[1:], rel=1e-5)


LOGGED = ("load_balancing_loss", "z_loss")


def test_every_layout_logs_the_one_process_moe_losses(curves, moe_one_process, cp_runs):
    """The logged load-balancing loss and z-loss (Megatron's track_moe_metrics: without their
    coefficients, the mean over MoE layers and microbatches) are the one-process figures on
    every layout: the stages' layers summed, tensor- and context-parallel shares added (the
    z-loss's means averaged), data-parallel ranks averaged."""
    one, pp2, interleaved, dp2, zbv, _, tp2 = curves
    runs = [pp2, interleaved, dp2, zbv, tp2, *(cp_runs[n] for n in ("cp2-p2p", "tp2-sp-cp2-p2p"))]
    for name in LOGGED:
        want = [h[name] for h in one]
        assert 0.5 < want[0] < 5  # a figure of the Switch loss's size (1 when balanced)
        for run in runs:
            assert [h[name] for h in run] == pytest.approx(want, **SAME_RUN), name
    plain = launch(tw.train_kw, 1, dict(TRAIN, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None),
                   timeout=300)[0]  # fmt: skip
    assert not any(name in plain[0] for name in LOGGED)  # nothing computed, nothing logged


def test_recomputation_logs_each_loss_once(moe_one_process):
    """Full recomputation runs each MoE layer's forward twice; the losses are recorded when
    their gradients are seeded, once."""
    full = launch(tw.train_kw, 1, dict(TRAIN, recompute_granularity="full"), timeout=300)[0]
    for name in LOGGED:
        assert [h[name] for h in full] == pytest.approx(
            [h[name] for h in moe_one_process], rel=1e-6
        )


# Context parallelism: (processes, layout, moe_workers.train_mistaken's mistake or None).
CP2 = dict(TRAIN, context_parallel_size=2)
CP_RUNS = {
    "cp2-p2p": (2, dict(CP2, cp_comm_type="p2p"), None),
    "cp2-all_gather": (2, dict(CP2, cp_comm_type="all_gather"), None),
    "cp2-a2a": (2, dict(CP2, cp_comm_type="a2a"), None),
    "tp2-sp-cp2-p2p": (4, dict(CP2, **TP2, cp_comm_type="p2p"), None),
    # The mistakes this exists to catch.
    "counts-over-t-only": (2, CP2, "counts-over-t-only"),
    "tp2-sp-cp2-counts-over-t-only": (4, dict(CP2, **TP2), "counts-over-t-only"),
    "z-undivided": (2, CP2, "z-undivided"),
    "seed-without-cp": (2, CP2, "seed-without-cp"),
}


@pytest.fixture(scope="module")
def cp_runs():
    return {
        name: launch(mw.train_mistaken, n, kw, mistake, timeout=300)[0]
        for name, (n, kw, mistake) in CP_RUNS.items()
    }


@pytest.mark.parametrize("name", [n for n, c in CP_RUNS.items() if c[2] is None])
def test_context_parallel_runs_follow_the_one_process_curve(moe_one_process, cp_runs, name):
    """Each cp rank routes its own part of every sequence; the load-balancing loss counts
    the experts' tokens over t x cp, the z-loss coefficient is divided by t cp, and both
    losses' gradients are seeded cp times the loss's factor (the gradients are averaged over
    the cp ranks): the one-process run, under each exchange of keys and values, and at
    tp2 x cp2 with sequence parallelism."""
    want = [h["loss"] for h in moe_one_process]
    assert [h["loss"] for h in cp_runs[name]] == pytest.approx(want, **SAME_RUN)


@pytest.mark.parametrize("name", [n for n, c in CP_RUNS.items() if c[2] is not None])
def test_the_context_parallel_curve_catches_a_wrong_factor(moe_one_process, cp_runs, name):
    want = [h["loss"] for h in moe_one_process]
    assert [h["loss"] for h in cp_runs[name]] != pytest.approx(want, **SAME_RUN)


def test_a_checkpoint_resumes_on_the_curve(tmp_path):
    straight = launch(tw.train_kw, 2, dict(TRAIN, pipeline_model_parallel_size=2),
                      timeout=300)[-1]  # fmt: skip
    pp2 = dict(TRAIN, pipeline_model_parallel_size=2)
    trained, resumed = tw.saved_and_resumed(2, pp2, 1, TRAIN, tmp_path / "ckpt")
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(straight, resumed, **SAME_RUN)


@pytest.mark.parametrize("save_tp,run_tp", [(2, 1), (1, 2)])
def test_a_tensor_parallel_checkpoint_resumes_at_another_size(tmp_path, curves, save_tp, run_tp):
    """megart's checkpoint reshards the experts' pieces by their partition_dim: saved at tp2,
    resumed at tp1, and the other way round, the weights and Adam's moments are what were
    saved, and the run goes on on the one-process curve."""
    layouts = {1: TRAIN, 2: dict(TRAIN, **TP2)}
    trained, resumed = tw.saved_and_resumed(
        save_tp, layouts[save_tp], run_tp, layouts[run_tp], tmp_path / "ckpt"
    )
    tw.assert_holds(trained, resumed)
    tw.assert_resumed_on_curve(curves[0], resumed, **SAME_RUN)


def test_megatrons_legacy_checkpoint_of_tensor_parallel_experts_loads_in_megatron_core():
    """megart's weights converted to Megatron-LM's legacy files split over two tensor-parallel
    ranks (the experts' linear_fc1 rows, SwiGLU's [gate_r; up_r], and linear_fc2 columns, the
    router whole): Megatron-Core's tp2 GPTModel loads each rank's file strictly and gives
    megart's logits."""
    import sweep_mcore_tp as smt

    def failed(e: Exception, what: str) -> str:
        return f"ERROR {type(e).__name__}: {e} {what}"

    kw = {**BASE, **LLAMA, "normalization": "layernorm", "moe_router_pre_softmax": True}
    verdict = smt.check(kw, launch, failed, 1e-6)
    assert verdict.startswith("OK"), verdict
    swapped = smt.check(kw, launch, failed, 1e-6, swap_ranks=True)  # a wrong split shows
    assert swapped.startswith("MISMATCH"), swapped


@pytest.mark.parametrize(
    "kw", [{}, dict(fp16=True, loss_scale=64.0), dict(global_batch_size=16)], ids=str
)
def test_the_engine_seeds_the_auxiliary_losses_as_it_scales_the_loss(kw):
    """What the gradient comparison above takes as given (its factor set by hand): the engine
    tells the chunks the loss's factor, loss scale / m, before each run."""
    got, want = launch(mw.auxiliary_factor, 1, dict(MODEL, **kw), timeout=300)[0]
    assert got == want and want != 1.0
