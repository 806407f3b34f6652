"""Hugging Face Qwen3-MoE interop: a Qwen3-MoE is megart's Qwen3-style GPT (--qk-layernorm) with
--num-experts on the layers transformers' decoder_sparse_step and mlp_only_layers give experts
(megart's per-layer --moe-layer-freq list). Against transformers' own Qwen3MoeForCausalLM: its
routing is megart's default (norm_topk_prob true) or --moe-router-pre-softmax (false), checked
on numbers; its logits from megart's GPT, its files written back exactly and loaded by
transformers with the same logits; megart MoE models and a pp2 training checkpoint written in its
format; a wrong mapping caught by the logit bound; what either side cannot represent refused by
name; and an imported Qwen3-MoE fine-tuned under pipeline parallelism with the flags import-hf
prints."""

import dataclasses
import json

import pytest
import torch

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.moe import route
from megart.training.export_hf import export_checkpoint
from test_hf_llama import randomized, relative_error, saved_hf
from test_hf_mixtral import (
    assert_fine_tunes_at_pp2,
    imported_at_pp2,
    rewritten,
    routed,
    swap,
    swap_experts,
    tokens,
)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# Two key/value heads of 16 channels on h 32 (--kv-channels), untied, four layers, four experts
# 24 wide (dense layers 48) of which each token takes two; norm_topk_prob false by default.
HF_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
               tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-5)  # fmt: skip
# (transformers' config changes, megart's moe_layer_freq for them)
VARIANTS = {
    "normalised-every-layer": (dict(norm_topk_prob=True), 1),
    # Layers 1 and 3 (from 0) sparse: (i + 1) % 2 == 0, where megart's int 2 would be 0 and 2.
    "unnormalised-sparse-step-2": (dict(decoder_sparse_step=2), (0, 1, 0, 1)),
    # Tied, heads h / heads wide, experts as wide as the dense MLP, a window of 8 on 24 tokens.
    "mlp-only-top3-window": (dict(mlp_only_layers=[0, 3], num_experts_per_tok=3,
                                  norm_topk_prob=True, use_sliding_window=True, sliding_window=8,
                                  max_window_layers=0, tie_word_embeddings=True, head_dim=8,
                                  moe_intermediate_size=48),
                             (0, 1, 1, 0)),
}  # fmt: skip
QWEN3_MOE = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
                 bias=False, qk_layernorm=True, num_experts=4)  # fmt: skip
# float32 on both sides; rope angles and the experts' sums in another order: measured 1.9e-7
# to 7.2e-7 relative; a wrong mapping is far more off (test_a_wrong_mapping_fails_the_logit_bound).
BOUND = 1e-5


def saved_qwen3_moe(root, **changes) -> object:
    """transformers' own Qwen3-MoE (saved_hf's: norm scales, q/k norms too, away from 1)."""
    config = transformers.Qwen3MoeConfig(**{**HF_TINY, **changes})
    return saved_hf(root, transformers.Qwen3MoeForCausalLM, config)


def moe(**kw) -> GPTConfig:
    base = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=3,
                num_attention_heads=4, ffn_hidden_size=48)  # fmt: skip
    return GPTConfig(**{**base, **QWEN3_MOE, **kw})


@pytest.mark.parametrize("normalised, k", [(True, 2), (True, 3), (False, 1), (False, 3)])
def test_qwen3_moe_routing_is_megarts_default_or_pre_softmax(normalised, k):
    """transformers' Qwen3MoeTopKRouter (softmax over all experts in fp32, the top k, divided by
    their sum with norm_topk_prob) gives megart's default routing with norm_topk_prob true and
    --moe-router-pre-softmax's with it false."""
    cfg = moe(num_experts=8, moe_router_topk=k, moe_router_pre_softmax=not normalised)
    config = {**HF_TINY, "num_experts": 8, "num_experts_per_tok": k, "norm_topk_prob": normalised}
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
        transformers.Qwen3MoeConfig(**config)
    )
    assert_routes_as(router, cfg, normalised, k)


def assert_routes_as(router: object, cfg: GPTConfig, normalised: bool, k: int) -> None:
    """transformers' ``router`` (norm_topk_prob ``normalised``, top ``k``) routes random
    tokens as megart's ``cfg``, and not as the other reading of norm_topk_prob."""
    logits, theirs = routed(router, seed=k)
    ours, _ = route(logits, cfg)
    assert (ours - theirs).abs().max() < 1e-6  # float32 softmaxes: measured up to 1.8e-7
    if k > 1:  # what the bound catches: the other reading of norm_topk_prob
        other = dataclasses.replace(cfg, moe_router_pre_softmax=normalised)
        assert (route(logits, other)[0] - theirs).abs().max() > 0.05


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_qwen3_moe_loads_and_writes_back_exactly(tmp_path, variant):
    changes, pattern = VARIANTS[variant]
    hf = saved_qwen3_moe(tmp_path / "hf", **changes)
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    c = ours.cfg
    normalised = changes.get("norm_topk_prob", False)
    assert (c.num_experts, c.moe_layer_freq, c.moe_router_pre_softmax) == (
        4,
        pattern,
        not normalised,
    )
    assert c.qk_layernorm and (c.ffn_size, c.moe_ffn_size) == (
        48,
        changes.get("moe_intermediate_size", 24),
    )
    assert c.window_size == ((7, 0) if "sliding_window" in changes else None)
    written = assert_written_back(ours, hf, tmp_path / "back", pattern, normalised)
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]


def assert_written_back(ours: GPT, hf: object, root, pattern: object, normalised: bool) -> dict:
    """megart's ``ours``, read from transformers' 4-layer ``hf``, gives its logits; written to
    ``root`` (the experts on ``pattern``'s layers, norm_topk_prob ``normalised``) and loaded by
    transformers, it holds ``hf``'s every tensor bit for bit and computes its logits exactly.
    Returns the config.json written."""
    x = tokens(1)
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(ours(x), expected) < BOUND
    ours.save_hf(str(root))
    written = json.loads((root / "config.json").read_text())
    dense = [i for i, moe_layer in enumerate(pattern if pattern != 1 else [1] * 4) if not moe_layer]
    assert (written["mlp_only_layers"], written["decoder_sparse_step"]) == (dense, 1)
    assert written["norm_topk_prob"] == normalised
    back = type(hf).from_pretrained(root).eval()
    original = hf.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, value in back.state_dict().items():
        assert torch.equal(value, original[name]), name
    with torch.no_grad():  # the config too: the same network, computed the same way
        assert torch.equal(back(x).logits, expected)
    return written


def _experts(tensors: dict, router_too: bool) -> None:
    weights = ("gate_proj", "up_proj", "down_proj")
    swap_experts(tensors, "model.layers.1.mlp.", weights, router_too)


def _gate_up(tensors: dict, prefixes: list[str]) -> None:
    """gate_proj and up_proj swapped in each MLP of ``prefixes``, as a conversion mixing the two
    would."""
    for g in prefixes:
        swap(tensors, g + "gate_proj.weight", g + "up_proj.weight")


SPARSE, DENSE = (1, 3), (0, 2)
SABOTAGE = {  # on the sparse-step-2 Qwen3-MoE: layers 1 and 3 have experts, 0 and 2 not
    "expert-gate-up-swapped": lambda t: _gate_up(
        t, [f"model.layers.{i}.mlp.experts.{e}." for i in SPARSE for e in range(4)]
    ),
    "experts-permuted": lambda t: _experts(t, router_too=False),
    "dense-gate-up-swapped": lambda t: _gate_up(t, [f"model.layers.{i}.mlp." for i in DENSE]),
}  # fmt: skip


@pytest.mark.parametrize("sabotage", [*SABOTAGE, "norm-topk-prob-misread"])
def test_a_wrong_mapping_fails_the_logit_bound(tmp_path, sabotage):
    """The files read as if megart mapped a projection, the experts or the routing wrongly:
    the logits leave the bound the tests above hold; the experts permuted with their router
    rows stay within it."""
    hf = saved_qwen3_moe(tmp_path / "hf", decoder_sparse_step=2)
    x = tokens(2)
    if sabotage == "norm-topk-prob-misread":  # as if megart read false as its default
        bad = rewritten(tmp_path / "hf", tmp_path / "bad", lambda t: None)
        config = json.loads((tmp_path / "bad" / "config.json").read_text())
        (tmp_path / "bad" / "config.json").write_text(
            json.dumps({**config, "norm_topk_prob": True})
        )
    else:
        bad = rewritten(tmp_path / "hf", tmp_path / "bad", SABOTAGE[sabotage])
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(GPT.from_hf(bad).eval()(x), expected) > 100 * BOUND
        same = rewritten(tmp_path / "hf", tmp_path / "same", lambda t: _experts(t, True))
        assert relative_error(GPT.from_hf(same).eval()(x), expected) < BOUND


@pytest.mark.parametrize(
    "changes, dense",
    [
        # Megatron's every-other-layer from the first (0 and 2): layer 1 dense.
        (dict(moe_layer_freq=2, moe_router_pre_softmax=True, moe_ffn_hidden_size=40,
              window_size=(5, 0)), [1]),
        (dict(moe_router_topk=3, kv_channels=16, num_query_groups=2, apply_layernorm_1p=True), []),
        (dict(moe_layer_freq=(0, 1, 1), moe_router_topk=1, moe_router_pre_softmax=True,
              untie_embeddings_and_output_weights=True), [0]),
    ],
)  # fmt: skip
def test_a_megart_moe_model_is_written_as_a_qwen3_moe(tmp_path, changes, dense):
    model = randomized(GPT(moe(**changes)), seed=3)
    model.save_hf(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["model_type"], written["mlp_only_layers"]) == ("qwen3_moe", dense)
    assert written["moe_intermediate_size"] == changes.get("moe_ffn_hidden_size", 48)
    assert written["sliding_window"] == (6 if "window_size" in changes else None)
    x = tokens(4, 16) % 100
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = model(x)
        assert relative_error(hf(x).logits, expected) < BOUND
        back = GPT.from_hf(str(tmp_path)).eval()
        assert relative_error(back(x), expected) < BOUND
    assert [back.cfg.is_moe_layer(i) for i in range(3)] == [i not in dense for i in range(3)]
    if not changes.get("apply_layernorm_1p"):  # otherwise the same network stored another way
        for name, p in back.named_parameters():
            assert torch.equal(p, model.get_parameter(name)), name


def test_a_pp2_moe_checkpoint_exports_as_the_qwen3_moe_its_ranks_trained(tmp_path):
    flags = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 disable_bias_linear=True, qk_layernorm=True, num_experts=4,
                 moe_layer_freq="[1,0,0,1]", moe_router_pre_softmax=True, moe_ffn_hidden_size=24,
                 moe_aux_loss_coeff=0.01)  # fmt: skip
    kw = dict(save=str(tmp_path / "ckpt"), train_iters=2, pipeline_model_parallel_size=2, **flags)
    weights = {}
    for rank in launch(tw.weights_after_training, 2, kw, timeout=300):
        weights.update(rank)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert (written["mlp_only_layers"], written["norm_topk_prob"]) == ([1, 2], False)
    back = GPT.from_hf(str(out))
    assert dict(back.named_parameters()).keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(back.get_parameter(name).detach()[: value.shape[0]], value), name
    x = tokens(5, 16)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert relative_error(hf(x).logits, back.eval()(x)) < BOUND


def test_import_hf_prints_the_moe_flags_and_pp2_fine_tunes_from_them(tmp_path, capsys):
    # Layers 0 and 3 sparse: the second stage's first layer dense, unlike the first's (the
    # import probes each stage's own layers).
    hf = saved_qwen3_moe(tmp_path / "hf", mlp_only_layers=[1, 2])
    flags = imported_at_pp2(tmp_path / "hf", tmp_path / "ckpt", capsys)
    for flag in ("--moe-layer-freq [1,0,0,1]", "--moe-router-pre-softmax", "--qk-layernorm",
                 "--moe-ffn-hidden-size 24", "--kv-channels 16", "--num-experts 4"):  # fmt: skip
        assert flag in " ".join(flags), flag
    model = assert_fine_tunes_at_pp2(flags, tmp_path / "ckpt", tmp_path / "hf", hf)
    assert (model["moe_layer_freq"], model["moe_router_pre_softmax"]) == ("[1,0,0,1]", True)


def test_a_qwen3_moe_without_sparse_layers_loads_as_the_qwen3_it_is(tmp_path):
    hf = saved_qwen3_moe(tmp_path, mlp_only_layers=[0, 1, 2, 3])
    ours = GPT.from_hf(str(tmp_path)).eval()
    assert ours.cfg.num_experts is None and ours.cfg.qk_layernorm
    x = tokens(6)
    with torch.no_grad():
        assert relative_error(ours(x), hf(x).logits) < BOUND


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        (dict(moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling-factor 2.0"),
        (dict(window_size=(3, 0), window_attn_skip_freq=(1, 0, 1)), "Qwen3-MoE's sliding window"),
        (dict(qk_layernorm=False), "Qwen3-MoE checkpoint cannot represent no --qk-layernorm"),
        (dict(num_experts=None), "Qwen3-MoE checkpoint only for a model with --num-experts"),
    ],
)
def test_a_megart_model_qwen3_moe_cannot_represent_is_refused_naming_the_flag(
    tmp_path, changes, named
):
    with pytest.raises(ConfigError, match=named):
        GPT(moe(**changes)).save_hf(str(tmp_path), expect="qwen3_moe")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(shared_expert_intermediate_size=16), "shared_expert_intermediate_size 16"),
        (dict(num_experts_per_tok=1, norm_topk_prob=True),
         "num_experts_per_tok 1 with norm_topk_prob true, which megart's GPT cannot"),
        (dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
         "max_window_layers 2: transformers 5 windows every layer"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step 0"),
        (dict(attention_bias=True), "this Qwen3-MoE has attention_bias true"),
        (dict(hidden_act="gelu"), "this Qwen3-MoE has hidden_act 'gelu'"),
    ],
)  # fmt: skip
def test_qwen3_moes_megart_cannot_represent_are_refused_naming_what(tmp_path, changes, named):
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**HF_TINY)).save_pretrained(
        tmp_path
    )
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConfigError, match=named):
        GPT.from_hf(str(tmp_path))
