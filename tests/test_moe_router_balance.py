"""DeepSeek-V3's router options (models.moe_router): aux-loss-free balancing by an expert bias
(--moe-router-enable-expert-bias, --moe-router-bias-update-rate), the sequence-wise and global
load-balancing losses (--moe-router-load-balancing-type seq_aux_loss, global_aux_loss) and
group-limited routing (--moe-router-num-groups, --moe-router-group-topk), against Megatron-Core
0.16.1's own: its routing function on the same logits, its MoE GPTModel's logits with the same
expert biases and one training step's gradients (float64; two microbatches for the global
loss), its update rule of the bias (its own function) on megart's counts over several steps of
megart's trainer; what cannot run is refused by name (megart's runs of them at every layout,
and their checkpoints: tests/test_moe_router_balance_runs.py). Each comparison catches a
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
        assert sum(theirs) > 0.1 and ours == pytest.approx(theirs, rel=1e-6), logged
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
