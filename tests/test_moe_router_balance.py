"""DeepSeek-V3's router options (models.moe_router): aux-loss-free balancing by an expert bias
(--moe-router-enable-expert-bias, --moe-router-bias-update-rate), the sequence-wise and global
load-balancing losses (--moe-router-load-balancing-type seq_aux_loss, global_aux_loss) and
group-limited routing (--moe-router-num-groups, --moe-router-group-topk), against Megatron-Core
0.16.1's own: its routing function on the same logits, its MoE GPTModel's logits with the same
expert biases and one training step's gradients (float64; two microbatches for the global
loss), its update rule of the bias (its own function) on megart's counts over several steps of
megart's trainer. Then megart's runs: dp2, tp2 with sequence parallelism, pp2, cp2, ep2 and full
recomputation end with the one-process run's expert biases, losses and logged sequence loss,
and the global loss's runs follow theirs; a checkpoint in each of megart's formats resumes on
the curve with its biases, at another layout, and Megatron-Core loads the Megatron-LM formats'
biases (and megart its store's); what cannot run is refused by name. Each comparison catches a
mistake made on purpose."""

import argparse

import pytest
import torch

import moe_router_workers as rw
import moe_workers as mw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPTConfig
from train_workers import SAME_RUN

BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            bias=False, num_experts=8)  # fmt: skip
SIGMOID = dict(moe_router_score_function="sigmoid")
BIAS = dict(SIGMOID, moe_router_enable_expert_bias=True)
GROUPS = dict(moe_router_num_groups=2, moe_router_group_topk=1)  # 2 groups of 4: one chosen
SEQ = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1,
           moe_z_loss_coeff=0.01)  # fmt: skip
GLOBAL = dict(SEQ, moe_router_load_balancing_type="global_aux_loss")

ROUTING = {
    "sigmoid-bias-top2": ({**BASE, **BIAS}, 1),
    "sigmoid-bias-top3-scaled": (
        {**BASE, **BIAS, "moe_router_topk": 3, "moe_router_topk_scaling_factor": 2.5}, 2),
    "softmax-groups": ({**BASE, **GROUPS}, 3),
    "pre-softmax-groups-top3": (
        {**BASE, **GROUPS, "moe_router_pre_softmax": True, "moe_router_topk": 3}, 4),
    "sigmoid-bias-4-groups-top4": (
        {**BASE, **BIAS, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
         "moe_router_topk": 4}, 5),
}  # fmt: skip


@pytest.fixture(scope="module")
def megatron():
    """Everything compared with Megatron-Core, in one launched process."""
    routing = launch(rw.routing, 1, list(ROUTING.values()), timeout=300)[0]
    logits = launch(rw.logits_all, 1, list(LOGITS.values()), timeout=300)[0]
    grads = launch(mw.gradients_all, 1, list(GRADIENTS.values()), timeout=300)[0]
    return (dict(zip(ROUTING, routing, strict=True)), dict(zip(LOGITS, logits, strict=True)),
            dict(zip(GRADIENTS, grads, strict=True)))  # fmt: skip


@pytest.mark.parametrize("name", list(ROUTING))
def test_routing_is_megatron_cores(megatron, name):
    """The same choices, and the same weights (to its fp32 softmax), on logits where the bias
    or the groups move most tokens off the plain top k."""
    r = megatron[0][name]
    assert r["same_choice"]
    assert r["weights"] < 1e-6
    assert r["moved"] > 16  # of 64 tokens


LOGITS = {
    "bias": ({**BASE, **BIAS}, 1, None),
    "bias-and-groups": ({**BASE, **BIAS, "moe_router_num_groups": 4, "moe_router_group_topk": 2},
                        2, None),
    "groups-pre-softmax": ({**BASE, **GROUPS, "moe_router_pre_softmax": True}, 3, None),
    # The mistake this exists to catch: the bias in the routing weights too.
    "bias-in-weights": ({**BASE, **BIAS}, 1, "bias-in-weights"),
}  # fmt: skip


@pytest.mark.parametrize("name", [n for n, c in LOGITS.items() if c[2] is None])
def test_megatron_core_computes_megarts_logits_with_the_same_expert_bias(megatron, name):
    r = megatron[1][name]
    assert r["scale"] > 0.5
    assert r["diff"] < 1e-6


def test_the_logits_catch_the_bias_in_the_weights(megatron):
    assert megatron[1]["bias-in-weights"]["diff"] > 1e-2


GRADIENTS = {
    # (model, loss factor, megart's factor, megart's model changes, expert biases' seed,
    # microbatches)
    "seq-aux-loss-softmax": ({**BASE, **SEQ}, 0.5, None, None, None),
    "seq-aux-loss-pre-softmax-top1": (
        {**BASE, **SEQ, "moe_router_topk": 1, "moe_router_pre_softmax": True}, 0.25, None, None,
        None),
    "seq-aux-loss-sigmoid-bias-groups": (
        {**BASE, **SEQ, **BIAS, "moe_router_num_groups": 4, "moe_router_group_topk": 2}, 0.5,
        None, None, 7),
    "aux-loss-sigmoid-bias": ({**BASE, **BIAS, **SEQ, "moe_router_load_balancing_type":
                              "aux_loss"}, 0.5, None, None, 8),
    # global_aux_loss: the second microbatch's counts the mean of both microbatches'.
    "global-aux-loss-two-microbatches": ({**BASE, **GLOBAL}, 0.5, None, None, None, 2),
    "global-aux-loss-sigmoid-bias-two-microbatches": (
        {**BASE, **GLOBAL, **BIAS}, 0.25, None, None, 9, 2),
    # The mistakes this exists to catch: the microbatch's loss for each sequence's, and for
    # the global batch's.
    "seq-as-microbatch": ({**BASE, **SEQ}, 0.5, None,
                          dict(moe_router_load_balancing_type="aux_loss"), None),
    "global-as-microbatch": ({**BASE, **GLOBAL}, 0.5, None,
                             dict(moe_router_load_balancing_type="aux_loss"), None, 2),
}  # fmt: skip
KINDS = {"seq": "seq_load_balancing_loss", "global": "global_load_balancing_loss"}


@pytest.mark.parametrize("name", [n for n, c in GRADIENTS.items() if c[3] is None])
def test_a_training_step_has_megatron_cores_gradients(megatron, name):
    """Every parameter's gradient, the router's included, with the load-balancing loss of
    each sequence, of the microbatch or of the global batch (two microbatches) and the
    z-loss; the logged losses (Megatron-Core's tracker's names); the tokens each expert got,
    counted for the bias's update, where the bias is on."""
    r = megatron[2][name]
    assert r["top"] > 1e-3
    assert r["largest"] < 1e-6
    assert r["router"] < 1e-6
    want = KINDS.get(name.split("-")[0], "load_balancing_loss")
    assert set(r["logged"]) == {want, "z_loss"}
    for logged, (ours, theirs) in r["logged"].items():
        assert theirs > 0.1 and ours == pytest.approx(theirs, rel=1e-6), logged
    assert r["counted"] == ([True, True] if "bias" in name else [])


@pytest.mark.parametrize("name", ["seq-as-microbatch", "global-as-microbatch"])
def test_the_gradients_catch_the_microbatchs_loss_for_anothers(megatron, name):
    assert megatron[2][name]["router"] > 1e-3


MODEL = dict(num_experts=4, disable_bias_linear=True, **BIAS, **SEQ)  # Megatron's update rate
TRAIN = dict(MODEL, train_iters=4)


def test_the_expert_bias_follows_megatron_cores_update_rule():
    """At each of 4 iterations of megart's trainer, the biases after its update are
    Megatron-Core's get_updated_expert_bias of the counts and biases before it, exactly; the
    counts are the batch's k choices per token in every layer, and the bias moves each step."""
    r = launch(rw.bias_steps, 1, TRAIN, timeout=300)[0]
    assert len(r["steps"]) == 4
    tokens = 8 * 16 * 2  # global batch x sequence x top k
    for step in r["steps"]:
        assert torch.equal(step["after"], step["megatron"])
        assert step["counts"].sum(dim=1).tolist() == [tokens] * 4
        assert not torch.equal(step["after"], step["before"])
    assert r["steps"][-1]["after"].abs().max() > 0


TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
# name: (processes, flags, train_bias's mistake or None, the rank whose figures to read)
RUNS = {
    "dp2": (2, TRAIN, None, 0),
    "tp2-sp": (2, dict(TRAIN, **TP2), None, 0),
    "pp2": (2, dict(TRAIN, pipeline_model_parallel_size=2), None, -1),
    "cp2": (2, dict(TRAIN, context_parallel_size=2), None, 0),
    "ep2": (2, dict(TRAIN, expert_model_parallel_size=2), None, 0),
    "recompute-full": (1, dict(TRAIN, recompute_granularity="full"), None, 0),
    # The mistakes this exists to catch.
    "dp2-counts-unsummed": (2, TRAIN, "counts-unsummed", 0),
    "tp2-sp-counts-unsummed": (2, dict(TRAIN, **TP2), "counts-unsummed", 0),
    "cp2-counts-over-tp-only": (2, dict(TRAIN, context_parallel_size=2), "counts-over-tp-only", 0),
    "tp2-sp-seq-counts-local": (2, dict(TRAIN, **TP2), "seq-counts-local", 0),
    "cp2-seq-counts-local": (2, dict(TRAIN, context_parallel_size=2), "seq-counts-local", 0),
}


@pytest.fixture(scope="module")
def one_process():
    return launch(rw.train_bias, 1, TRAIN, timeout=300)[0]


@pytest.fixture(scope="module")
def runs():
    return {
        name: launch(rw.train_bias, n, kw, mistake, timeout=300)[rank]
        for name, (n, kw, mistake, rank) in RUNS.items()
    }


@pytest.mark.parametrize("name", [n for n, c in RUNS.items() if c[2] is None])
def test_every_layout_ends_with_the_one_process_expert_biases(one_process, runs, name):
    """The counts are summed over the tensor-, data- and context-parallel ranks (and the
    stages' layers gathered for the figure), the sequence loss's counts over t x cp: the
    one-process biases exactly, its loss curve and its logged sequence loss."""
    want, got = one_process, runs[name]
    assert (want["bias"] != 0).sum() > 8  # of 4 layers x 4 experts
    assert torch.equal(got["bias"], want["bias"])
    assert [h["loss"] for h in got["history"]] == pytest.approx(
        [h["loss"] for h in want["history"]], **SAME_RUN
    )
    logged = [h["seq_load_balancing_loss"] for h in want["history"]]
    assert 0.5 < logged[0] < 5
    assert [h["seq_load_balancing_loss"] for h in got["history"]] == pytest.approx(
        logged, **SAME_RUN
    )
    assert "load_balancing_loss" not in got["history"][0]


@pytest.mark.parametrize("name", [n for n, c in RUNS.items() if "counts-unsummed" in n
                                  or "over-tp-only" in n])  # fmt: skip
def test_the_biases_catch_counts_not_summed_over_the_ranks(one_process, runs, name):
    assert not torch.equal(runs[name]["bias"], one_process["bias"])


@pytest.mark.parametrize("name", [n for n in RUNS if "seq-counts-local" in n])
def test_the_logged_sequence_loss_catches_counts_not_summed_over_the_ranks(one_process, runs, name):
    want = [h["seq_load_balancing_loss"] for h in one_process["history"]]
    got = [h["seq_load_balancing_loss"] for h in runs[name]["history"]]
    assert got != pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("fmt", ["megart", "torch", "torch_dist"])
def test_a_checkpoint_resumes_on_the_curve_with_its_expert_biases(tmp_path, one_process, fmt):
    """Saved at pp2 after 2 iterations (megart's files hold every layer's bias, Megatron-LM's
    legacy files each stage's under Megatron-Core's name too, its torch_dist store each layer's
    slice of Megatron-Core's key), resumed in one process:
    iterations 3 and 4 are the one-process run's, and so are its final biases; not so where
    the biases are not loaded (the run goes on from zeros)."""
    store = str(tmp_path / "ckpt")
    saving = dict(TRAIN, pipeline_model_parallel_size=2, exit_interval=2, save=store,
                  ckpt_format=fmt)  # fmt: skip
    launch(rw.train_bias, 2, saving, timeout=300)
    resumed = launch(rw.train_bias, 1, dict(TRAIN, load=store), timeout=300)[0]
    assert [h["iteration"] for h in resumed["history"]] == [3, 4]
    want = [h["loss"] for h in one_process["history"][2:]]
    assert [h["loss"] for h in resumed["history"]] == pytest.approx(want, **SAME_RUN)
    assert torch.equal(resumed["bias"], one_process["bias"])
    lost = launch(rw.train_bias, 1, dict(TRAIN, load=store), "bias-not-loaded", timeout=300)[0]
    assert not torch.equal(lost["bias"], one_process["bias"])


def test_megatron_core_loads_the_legacy_file_with_its_expert_biases(tmp_path):
    """megart train's --ckpt-format torch file (one rank): Megatron-Core's GPTModel loads it
    strictly, its routers' expert_bias buffers are megart's biases, and it gives the logits
    of megart's GPT with the checkpoint's weights and biases. megart's conversions, which
    carry weights alone, refuse it by name either way."""
    from megart.cli.main import main
    from megart.training.megatron_checkpoint import read_megatron

    store = str(tmp_path / "ckpt")
    launch(rw.train_bias, 1, dict(TRAIN, train_iters=2, save=store, ckpt_format="torch"),
           timeout=300)  # fmt: skip
    r = launch(rw.legacy_file_in_megatron_core, 1, store, timeout=300)[0]
    assert r["same_bias"] and r["nonzero"] > 4
    assert r["diff"] < 1e-6
    with pytest.raises(ConfigError, match="--moe-router-enable-expert-bias; megart carries"):
        read_megatron(store)
    out = str(tmp_path / "converted")
    argv = ["convert-checkpoint", "--load", store, "--save", out, "--from", "megart",
            "--to", "megatron"]  # fmt: skip
    assert main(argv) != 0


def test_megatron_core_loads_the_torch_dist_store_with_its_expert_biases(tmp_path):
    """megart train's --ckpt-format torch_dist store: Megatron-Core's GPTModel loads it
    strictly (its expert_bias key included) with megart's biases."""
    store = str(tmp_path / "dist")
    saved = launch(rw.train_bias, 1, dict(TRAIN, train_iters=2, save=store,
                   ckpt_format="torch_dist"), timeout=300)[0]  # fmt: skip
    loaded = launch(rw.store_biases_in_megatron_core, 1, store, timeout=300)[0]
    assert (saved["bias"] != 0).sum() > 4 and torch.equal(loaded, saved["bias"])


@pytest.mark.parametrize("freq", [1, 2])
def test_megart_reads_megatron_cores_store_of_expert_biases(tmp_path, freq):
    """Megatron-Core's own torch_dist save (its biases drawn at random): megart's load puts
    each layer's row into its router, with every layer under one key (--moe-layer-freq 1) or
    each its own (a mix of dense and MoE layers)."""
    from megart.models import GPT
    from megart.models.moe_router import biased_routers
    from megart.training.checkpoint import iteration_dir
    from megart.training.megatron_dist_train_load import load_expert_bias

    kw = {**BASE, **BIAS, "num_layers": 4, "moe_layer_freq": freq}
    want = launch(rw.megatron_core_store_with_biases, 1, kw, str(tmp_path), timeout=300)[0]
    ours = GPT(GPTConfig(**kw))
    load_expert_bias(iteration_dir(tmp_path, 3), [ours.chunk], 0)
    got = torch.stack([r.expert_bias for r in biased_routers([ours.chunk])])
    assert got.shape == want.shape and torch.equal(got, want)


GLOBAL_TRAIN = dict(num_experts=4, disable_bias_linear=True, **GLOBAL, train_iters=4)
ONE_BATCH = dict(micro_batch_size=2, global_batch_size=4)  # per data-parallel rank: one
# name: (processes, flags, train_bias's mistake or None, the rank whose figures to read)
GLOBAL_RUNS = {
    "dp2": (2, dict(GLOBAL_TRAIN, **ONE_BATCH), None, 0),
    "tp2-sp": (2, dict(GLOBAL_TRAIN, **TP2), None, 0),
    "cp2": (2, dict(GLOBAL_TRAIN, context_parallel_size=2), None, 0),
    "pp2": (2, dict(GLOBAL_TRAIN, pipeline_model_parallel_size=2), None, -1),
    # The mistake this exists to catch: the counts of each data-parallel rank alone.
    "dp2-counts-local": (2, dict(GLOBAL_TRAIN, **ONE_BATCH), "global-counts-local", 0),
}


@pytest.fixture(scope="module")
def global_runs():
    """The runs, and two one-process ones: of GLOBAL_TRAIN, and of dp2's global batch as one
    microbatch at half the coefficient (each dp2 rank's loss is its half of the batch's, and
    dp2 averages the ranks' gradients: half the one-process batch's)."""
    runs = {
        name: launch(rw.train_bias, n, kw, mistake, timeout=300)[rank]
        for name, (n, kw, mistake, rank) in GLOBAL_RUNS.items()
    }
    runs["one"] = launch(rw.train_bias, 1, GLOBAL_TRAIN, timeout=300)[0]
    half = dict(GLOBAL_TRAIN, micro_batch_size=4, global_batch_size=4, moe_aux_loss_coeff=0.05)
    runs["one-batch"] = launch(rw.train_bias, 1, half, timeout=300)[0]
    return runs


def _figures(run: dict, name: str) -> list[float]:
    return [h[name] for h in run["history"]]


@pytest.mark.parametrize("name", [n for n, c in GLOBAL_RUNS.items() if c[2] is None])
def test_global_aux_loss_runs_follow_the_one_process_curve(global_runs, name):
    """The counts are summed over the tensor-, data- and context-parallel ranks and averaged
    over the iteration's microbatches so far: tp2 with sequence parallelism, cp2 and pp2 are
    the one-process run, dp2 its global batch in one microbatch at half the coefficient; the
    logged global_load_balancing_loss (the ranks' shares summed) too."""
    want = global_runs["one-batch" if name == "dp2" else "one"]
    got = global_runs[name]
    assert _figures(got, "loss") == pytest.approx(_figures(want, "loss"), **SAME_RUN)
    logged = _figures(want, "global_load_balancing_loss")
    assert 0.5 < logged[0] < 5
    assert _figures(got, "global_load_balancing_loss") == pytest.approx(logged, **SAME_RUN)


def test_the_global_curve_catches_counts_of_one_data_parallel_rank(global_runs):
    want = _figures(global_runs["one-batch"], "global_load_balancing_loss")
    got = _figures(global_runs["dp2-counts-local"], "global_load_balancing_loss")
    assert got != pytest.approx(want, rel=1e-3)


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


MOE = ("--num-experts", "4", "--disable-bias-linear")


def test_the_flags_reach_the_model():
    cfg = parse(
        *MOE, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.01", "--moe-router-load-balancing-type",
        "seq_aux_loss", "--moe-aux-loss-coeff", "0.001", "--moe-router-num-groups", "2",
        "--moe-router-group-topk", "1",
    ).gpt_config()  # fmt: skip
    assert (cfg.moe_router_enable_expert_bias, cfg.moe_router_bias_update_rate) == (True, 0.01)
    assert cfg.moe_router_load_balancing_type == "seq_aux_loss"
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (2, 1)
    assert parse(*MOE).gpt_config().moe_router_bias_update_rate == 1e-3  # Megatron's default


def test_megatron_lm_args_carry_the_router_options():
    from megart.training.megatron_args import moe_args, moe_fields

    cfg = GPTConfig(**{**BASE, **BIAS, **SEQ, **GROUPS, "moe_router_bias_update_rate": 0.01})
    args = moe_args(cfg)
    assert args["moe_router_num_groups"] == 2 and args["moe_router_enable_expert_bias"]
    read = moe_fields({**args, "ffn_hidden_size": cfg.ffn_size})  # as Megatron's args hold it
    assert GPTConfig(**{**BASE, **read}) == cfg


@pytest.mark.parametrize(
    "argv,message",
    [
        ((*MOE, "--moe-router-enable-expert-bias"), "sigmoid scores only"),
        ((*MOE, "--moe-router-num-groups", "2"), "takes both"),
        ((*MOE, "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"),
         "split --num-experts 4 evenly"),
        ((*MOE, "--moe-router-num-groups", "2", "--moe-router-group-topk", "3"),
         "--moe-router-group-topk 3: .* 1 <= g <= G"),
        ((*MOE, "--moe-router-topk", "3", "--moe-router-num-groups", "4",
          "--moe-router-group-topk", "1"), "g <= k <= g x 1"),
        ((*MOE, "--moe-router-load-balancing-type", "sinkhorn"), "sinkhorn is not built"),
        ((*MOE, "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff",
          "0.1", "--recompute-granularity", "full"),
         "global_aux_loss with --recompute-granularity full: not built"),
        ((*MOE, "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.1"),
         "does not compute"),
    ],
)  # fmt: skip
def test_what_megart_cannot_run_is_refused_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).check(1)


@pytest.mark.parametrize("kw", [BIAS, GROUPS], ids=["expert-bias", "groups"])
@pytest.mark.parametrize("writer,qk", [("hf_mixtral", False), ("hf_qwen3_moe", True)])
def test_hugging_face_writers_refuse_the_router_options_by_name(kw, writer, qk):
    import importlib

    llama = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
                 untie_embeddings_and_output_weights=True, qk_layernorm=qk)  # fmt: skip
    cfg = GPTConfig(**{**BASE, **llama, **kw})
    check = importlib.import_module(f"megart.models.{writer}").check
    with pytest.raises(ConfigError, match="expert bias|top k of all experts"):
        check(cfg)
