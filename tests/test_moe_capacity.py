"""Token dropping (--moe-expert-capacity-factor, --moe-token-drop-policy,
--moe-pad-expert-input-to-capacity; models.moe_router.drop_tokens) against Megatron-Core 0.16.1's
own: its apply_router_token_dropping on random routings, its MoE GPTModel's routing maps, logits
and one training step's gradients (float64) with both policies and padding, where tokens are
dropped. Its position policy is compared with its torch.topk's ties taken in index order (the
latest tokens dropped, as it documents; torch.topk on the CPU returns tied 1s in no such order,
so that unpatched it keeps other tokens, which megart does not mirror). Then megart's runs: each
router drops over its own tokens, as Megatron-Core's: dp2 and ep2 (each rank routes its own
microbatch, the one-process run's microbatches) are on the one-process curve; tp2 with sequence
parallelism and cp2 route each rank's part of the sequence, so they are on the curve of the
one-process run whose routers drop over those parts apart, not the plain one's. Flags,
Megatron-LM's checkpoint args, refusals. Each comparison catches a mistake made on purpose."""

import argparse

import pytest

import moe_capacity_workers as cw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPTConfig
from megart.models.hf_experts import softmax_routing
from megart.training.megatron_args import config_from_args as from_megatron_args
from megart.training.megatron_args import moe_args
from train_workers import SAME_RUN

BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            bias=False, num_experts=8, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)  # fmt: skip
# 2 sequences of 16 tokens, top 2 of 8: T k / E = 8 per expert, capacity 4.
HALF = dict(BASE, moe_expert_capacity_factor=0.5)
POSITION = dict(moe_token_drop_policy="position")
PAD = dict(moe_pad_expert_input_to_capacity=True)
BIAS = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)

# name: (model, megart's model changes, Megatron-Core's position ties in order, mistake)
CASES = {
    "probs": (HALF, None, False, None),
    "probs-padded": ({**HALF, **PAD}, None, False, None),
    "position": ({**HALF, **POSITION}, None, True, None),
    "position-padded": ({**HALF, **POSITION, **PAD}, None, True, None),
    "probs-top3-pre-softmax": ({**HALF, "moe_router_topk": 3, "moe_router_pre_softmax": True,
                                "moe_expert_capacity_factor": 0.8}, None, False, None),
    "sigmoid-expert-bias": ({**HALF, **BIAS}, None, False, None),
    # A capacity above the tokens: nothing dropped; padded, every expert takes every token.
    "roomy-padded": ({**HALF, **PAD, "moe_expert_capacity_factor": 5.0}, None, False, None),
    # The mistakes this exists to catch.
    "position-for-probs": (HALF, POSITION, False, None),
    "probs-for-position": ({**HALF, **POSITION}, dict(moe_token_drop_policy="probs"), True, None),
    "capacity-plus-one": (HALF, None, False, "capacity-plus-one"),
}  # fmt: skip
DROP_CASES = [
    # (tokens, experts, topk, factor, policy, pad, seed)
    (64, 8, 2, 1.0, "probs", False, 1), (64, 8, 2, 0.5, "position", False, 2),
    (37, 4, 1, 0.3, "probs", True, 3), (37, 4, 1, 0.7, "position", True, 4),
    (48, 6, 3, 1.25, "probs", False, 5), (48, 6, 3, 1.25, "position", True, 6),
    (16, 4, 2, 3.0, "probs", True, 7), (16, 4, 2, 2.5, "position", False, 8),
]  # fmt: skip


@pytest.fixture(scope="module")
def megatron():
    """Everything compared with Megatron-Core, in launched processes."""
    drops = launch(cw.drop_cases, 1, DROP_CASES, timeout=300)[0]
    models = launch(cw.compare_all, 1, list(CASES.values()), timeout=600)[0]
    return drops, dict(zip(CASES, models, strict=True))


def test_dropping_is_megatron_cores_on_random_routings(megatron):
    """The same probs and map, bit for bit, and the same capacity, with both policies, with
    and without padding, where the capacity is below, near and above the tokens."""
    assert megatron[0] == [True] * len(DROP_CASES)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[1] is None and c[3] is None])
def test_megatron_core_drops_the_same_tokens_with_the_same_logits_and_gradients(megatron, name):
    """Each MoE layer's routing map after dropping is Megatron-Core's exactly, where tokens
    were dropped (most experts full); the logits and every gradient, the router's included,
    agree to its fp32 softmax; with padding every expert takes exactly its capacity; the
    expert bias counts the tokens kept, as Megatron-Core's."""
    r = megatron[1][name]
    assert r["same_map"] == [True, True]
    assert r["logits"] < 1e-6 and r["probs"] < 1e-6
    assert r["top"] > 1e-3
    assert r["largest"] < 1e-6 and r["router"] < 1e-6
    if name.startswith("roomy"):
        assert r["dropped"] == [0, 0] and r["least"] == r["most"] == [32, 32]
        return
    assert min(r["dropped"]) > 10  # of 2 x 32 copies (top 3: 3 x 32)
    capacity = 10 if "top3" in name else 4  # top 3: ceil(32 x 3 / 8 x 0.8)
    assert r["most"] == [capacity] * 2
    if "padded" in name:
        assert r["least"] == [capacity] * 2
    assert r["counted"] == ([True, True] if "bias" in name else [])


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[1] is not None or c[3]])
def test_the_comparison_catches_another_policy_or_capacity(megatron, name):
    r = megatron[1][name]
    assert r["same_map"] == [False, False]
    assert r["logits"] > 1e-3 and r["largest"] > 1e-3


MODEL = dict(num_experts=4, disable_bias_linear=True, moe_aux_loss_coeff=0.01,
             moe_expert_capacity_factor=0.5)  # fmt: skip
TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
# name: (processes, flags, how the one-process run to compare with drops)
RUNS = {
    "dp2": (2, MODEL, None),
    "ep2": (2, dict(MODEL, expert_model_parallel_size=2), None),
    "ep2-position-padded": (2, dict(MODEL, expert_model_parallel_size=2, **POSITION, **PAD), None),
    "tp2-sp": (2, dict(MODEL, **TP2), "tp2"),
    "cp2": (2, dict(MODEL, context_parallel_size=2), "cp2"),
}  # fmt: skip


@pytest.fixture(scope="module")
def one_process():
    """The one-process runs to compare with, by (flags' extra, split)."""
    runs = {}
    for _, kw, split in RUNS.values():
        single = {k: v for k, v in kw.items() if k not in TP2 and "parallel" not in k}
        key = (tuple(sorted(single.items())), split)
        if key not in runs:
            runs[key] = launch(cw.train, 1, single, split, timeout=300)[0]
    return runs


def _one_process_run(one_process, kw, split):
    single = {k: v for k, v in kw.items() if k not in TP2 and "parallel" not in k}
    return one_process[(tuple(sorted(single.items())), split)]


@pytest.mark.parametrize("name", list(RUNS))
def test_every_layout_is_on_the_curve_of_its_routers_tokens(one_process, name):
    """dp2 and ep2 route each rank's own microbatch (the one-process run's microbatches):
    the one-process curve. tp2+SP and cp2 drop over each rank's part of the sequence, as
    Megatron-Core's routers do: the one-process run dropping over those parts apart, and not
    the plain one-process curve (dropping over the whole sequence keeps other tokens)."""
    n, kw, split = RUNS[name]
    got = [h["loss"] for h in launch(cw.train, n, kw, timeout=300)[0]]
    want = [h["loss"] for h in _one_process_run(one_process, kw, split)]
    assert got == pytest.approx(want, **SAME_RUN)
    if split is not None:
        plain = [h["loss"] for h in _one_process_run(one_process, kw, None)]
        assert got != pytest.approx(plain, rel=1e-4)


def test_dropping_changes_the_curve(one_process):
    """The runs above would be equal without any dropping: 0.5 changes the one-process
    curve, and so does the position policy against probs (padding adds nothing)."""
    dropless = {k: v for k, v in MODEL.items() if "capacity" not in k}
    runs = [launch(cw.train, 1, dropless, timeout=300)[0],
            _one_process_run(one_process, MODEL, None),
            _one_process_run(one_process, dict(MODEL, **POSITION, **PAD), None)]  # fmt: skip
    losses = [[h["loss"] for h in r] for r in runs]
    assert losses[1] != pytest.approx(losses[0], rel=1e-4)
    assert losses[2] != pytest.approx(losses[1], rel=1e-4)


def _train_config(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--num-experts", "4", "--disable-bias-linear",
                                               *argv]))  # fmt: skip


def test_flags_and_megatron_lms_args_carry_the_capacity():
    """megart train's flags (Megatron-LM's names; a negative factor is none, as Megatron-Core
    reads it) and Megatron-LM's checkpoint args both ways."""
    flags = ["--moe-expert-capacity-factor", "1.5", "--moe-token-drop-policy", "position",
             "--moe-pad-expert-input-to-capacity"]  # fmt: skip
    cfg = _train_config(*flags).gpt_config()
    assert (cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy) == (1.5, "position")
    assert cfg.moe_pad_expert_input_to_capacity
    assert (
        _train_config("--moe-expert-capacity-factor", "-1").gpt_config().moe_expert_capacity_factor
        is None
    )
    args = moe_args(cfg)
    assert (args["moe_expert_capacity_factor"], args["moe_token_drop_policy"],
            args["moe_pad_expert_input_to_capacity"]) == (1.5, "position", True)  # fmt: skip
    full = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                max_position_embeddings=16, padded_vocab_size=128, ffn_hidden_size=128,
                add_bias_linear=False, **args)  # fmt: skip
    back = from_megatron_args(full)
    assert (back.moe_expert_capacity_factor, back.moe_token_drop_policy,
            back.moe_pad_expert_input_to_capacity) == (1.5, "position", True)  # fmt: skip
    older = {k: v for k, v in full.items() if "capacity" not in k and "drop" not in k}
    assert from_megatron_args(older).moe_expert_capacity_factor is None
    # Negative: none, as Megatron-Core reads it; its padding then refused, as Megatron-Core's.
    plain = dict(full, moe_token_drop_policy="probs", moe_pad_expert_input_to_capacity=False)
    unset = from_megatron_args(dict(plain, moe_expert_capacity_factor=-1.0))
    assert unset.moe_expert_capacity_factor is None
    with pytest.raises(ConfigError, match="--moe-pad-expert-input-to-capacity: the experts'"):
        from_megatron_args(dict(full, moe_expert_capacity_factor=-1.0))


@pytest.mark.parametrize(
    "kw, said",
    [
        (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor 0: each expert"),
        (dict(moe_token_drop_policy="latest", moe_expert_capacity_factor=1.0),
         "--moe-token-drop-policy latest: use probs"),
        (PAD, "--moe-pad-expert-input-to-capacity: the experts' capacity needs"),
        (POSITION, "--moe-token-drop-policy position: the experts' capacity needs"),
    ],
)  # fmt: skip
def test_what_cannot_drop_is_refused_by_name(kw, said):
    with pytest.raises(ConfigError, match=said):
        GPTConfig(**{**BASE, **kw})
    with pytest.raises(ConfigError, match="mixture-of-experts settings, but the model has no"):
        GPTConfig(**{**BASE, "num_experts": None, "moe_aux_loss_coeff": 0.0,
                     "moe_z_loss_coeff": None, "moe_expert_capacity_factor": 1.0})  # fmt: skip


def test_hugging_face_formats_refuse_dropping_by_name():
    """Mixtral's, Qwen2-MoE's and Qwen3-MoE's experts take every token routed to them."""
    unlike = softmax_routing(GPTConfig(**HALF), "Mixtral", "")
    assert ("--moe-expert-capacity-factor 0.5",
            "Mixtral's experts take every token routed to them (no capacity, nothing dropped)"
            ) in unlike  # fmt: skip
    assert all(not flag for flag, _ in softmax_routing(GPTConfig(**BASE), "Mixtral", ""))
