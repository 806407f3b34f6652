"""Hugging Face Qwen2-MoE interop: a Qwen2-MoE is megart's Llama-style GPT with --add-qkv-bias
(qkv_bias), --num-experts on the layers decoder_sparse_step and mlp_only_layers give experts,
and in each MoE layer a shared expert (--moe-shared-expert-intermediate-size) gated by
sigmoid(x . w) (--moe-shared-expert-gate). Against transformers' own Qwen2MoeForCausalLM: its
routing is megart's default (norm_topk_prob true) or --moe-router-pre-softmax (false), checked
on numbers; its logits from megart's GPT, its files written back exactly and loaded by
transformers with the same logits; megart models written in its format; a dropped gate, a gate
without its sigmoid and swapped gate/up projections caught by the logit bound; what either side
cannot represent refused by name; and an imported Qwen2-MoE fine-tuned under pipeline
parallelism with the flags import-hf prints (and imported at tensor-parallel size 2)."""

import json

import pytest
import torch

import megatron_core_ckpt_workers as mckw
import moe_workers as mw
import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.training.export_hf import export_checkpoint
from test_hf_llama import randomized, relative_error
from test_hf_mixtral import assert_fine_tunes_at_pp2, imported_at_pp2, rewritten, swap, tokens
from test_hf_qwen3_moe import assert_routes_as, assert_written_back

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# Two key/value heads on h 32, untied, four layers, four experts 24 wide (dense layers 48) of
# which each token takes two, a shared expert 40 wide; norm_topk_prob false by default.
HF_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
               shared_expert_intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
               max_position_embeddings=64, tie_word_embeddings=False, rope_theta=1e6,
               rms_norm_eps=1e-5)  # fmt: skip
# (transformers' config changes, megart's moe_layer_freq for them)
VARIANTS = {
    "normalised-every-layer": (dict(norm_topk_prob=True), 1),
    # Layers 1 and 3 (from 0) sparse: (i + 1) % 2 == 0, where megart's int 2 would be 0 and 2.
    "unnormalised-sparse-step-2": (dict(decoder_sparse_step=2), (0, 1, 0, 1)),
    # Tied, no q/k/v biases, top 3, a window of 8 on 24 tokens on layers 1 and 2.
    "mlp-only-top3-no-qkv-bias-window": (
        dict(mlp_only_layers=[0, 3], num_experts_per_tok=3, norm_topk_prob=True, qkv_bias=False,
             tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
             layer_types=["full_attention", "sliding_attention", "sliding_attention",
                          "full_attention"]),
        (0, 1, 1, 0),
    ),
}  # fmt: skip
QWEN2_MOE = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
                 bias=False, add_qkv_bias=True, num_experts=4,
                 moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True)  # fmt: skip
# float32 on both sides, as test_hf_qwen3_moe's bound (measured 1.2e-7 to 2.5e-7 relative); a
# wrong mapping or gate is 1.2e-3 (the shared expert's w1/w3 swapped) to 4.2e-2 (the gate
# without its sigmoid) off: test_a_wrong_mapping_or_gate_fails_the_logit_bound.
BOUND = 1e-5


def saved_qwen2_moe(root, **changes) -> object:
    """transformers' own Qwen2-MoE, its norm scales, q/k/v biases and shared experts' gates
    drawn away from their initial values (so that a misplaced one shows), saved in ``root``;
    returned in eval mode."""
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**HF_TINY, **changes}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("norm", "bias", "shared_expert_gate")):
                p.add_(torch.randn(p.shape) * 0.3)
    model.save_pretrained(root)
    return model.eval()


def qwen2_moe(**kw) -> GPTConfig:
    base = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=3,
                num_attention_heads=4, ffn_hidden_size=48)  # fmt: skip
    return GPTConfig(**{**base, **QWEN2_MOE, **kw})


@pytest.mark.parametrize("normalised, k", [(True, 2), (True, 3), (False, 1), (False, 3)])
def test_qwen2_moe_routing_is_megarts_default_or_pre_softmax(normalised, k):
    """transformers' Qwen2MoeTopKRouter (softmax over all experts in fp32, the top k, divided by
    their sum with norm_topk_prob) gives megart's default routing with norm_topk_prob true and
    --moe-router-pre-softmax's with it false."""
    cfg = qwen2_moe(num_experts=8, moe_router_topk=k, moe_router_pre_softmax=not normalised)
    config = {**HF_TINY, "num_experts": 8, "num_experts_per_tok": k, "norm_topk_prob": normalised}
    router = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter(
        transformers.Qwen2MoeConfig(**config)
    )
    assert_routes_as(router, cfg, normalised, k)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_qwen2_moe_loads_and_writes_back_exactly(tmp_path, variant):
    changes, pattern = VARIANTS[variant]
    hf = saved_qwen2_moe(tmp_path / "hf", **changes)
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    c = ours.cfg
    normalised = changes.get("norm_topk_prob", False)
    routing = (c.num_experts, c.moe_layer_freq, c.moe_router_pre_softmax)
    assert routing == (4, pattern, not normalised)
    assert (c.moe_shared_expert_intermediate_size, c.moe_shared_expert_gate) == (40, True)
    assert (c.ffn_size, c.moe_ffn_size, c.add_qkv_bias) == (48, 24, changes.get("qkv_bias", True))
    assert c.window_attn_skip_freq == ((0, 1, 1, 0) if "layer_types" in changes else None)
    written = assert_written_back(ours, hf, tmp_path / "back", pattern, normalised)
    assert written["architectures"] == ["Qwen2MoeForCausalLM"]
    assert written["shared_expert_intermediate_size"] == 40


def _gate_up(tensors: dict, prefixes: list[str]) -> None:
    """gate_proj and up_proj (w1 and w3) swapped in each MLP of ``prefixes``."""
    for g in prefixes:
        swap(tensors, g + "gate_proj.weight", g + "up_proj.weight")


SPARSE = (1, 3)  # the sparse-step-2 Qwen2-MoE's MoE layers
SABOTAGE = {
    "shared-gate-up-swapped": lambda t: _gate_up(
        t, [f"model.layers.{i}.mlp.shared_expert." for i in SPARSE]
    ),
    "expert-gate-up-swapped": lambda t: _gate_up(
        t, [f"model.layers.{i}.mlp.experts.{e}." for i in SPARSE for e in range(4)]
    ),
}
GATE_MISTAKES = ("gate-not-applied", "gate-without-sigmoid")  # moe_workers.gate_mistake


@pytest.mark.parametrize("sabotage", [*SABOTAGE, *GATE_MISTAKES])
def test_a_wrong_mapping_or_gate_fails_the_logit_bound(tmp_path, sabotage):
    """The files read as if megart mapped w1/w3 wrongly, or megart's shared experts left
    ungated or gated without the sigmoid: the logits leave the bound the tests above hold."""
    hf = saved_qwen2_moe(tmp_path / "hf", decoder_sparse_step=2)
    x = tokens(2)
    src = tmp_path / "hf"
    if sabotage in SABOTAGE:
        src = rewritten(tmp_path / "hf", tmp_path / "bad", SABOTAGE[sabotage])
    with torch.no_grad(), mw.gate_mistake(sabotage):
        expected = hf(x).logits
        assert relative_error(GPT.from_hf(str(src)).eval()(x), expected) > 20 * BOUND


@pytest.mark.parametrize(
    "changes, dense",
    [
        (dict(moe_layer_freq=2, moe_router_pre_softmax=True, moe_ffn_hidden_size=40,
              window_size=(5, 0), window_attn_skip_freq=(1, 0, 1)), [1]),
        (dict(moe_router_topk=3, kv_channels=16, num_query_groups=2, add_qkv_bias=False,
              moe_shared_expert_intermediate_size=16), []),
        (dict(moe_layer_freq=(0, 1, 1), moe_router_topk=1, moe_router_pre_softmax=True,
              untie_embeddings_and_output_weights=True), [0]),
    ],
)  # fmt: skip
def test_a_megart_model_with_gated_shared_experts_is_written_as_a_qwen2_moe(
    tmp_path, changes, dense
):
    model = randomized(GPT(qwen2_moe(**changes)), seed=3)
    model.save_hf(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["model_type"], written["mlp_only_layers"]) == ("qwen2_moe", dense)
    assert written["qkv_bias"] == changes.get("add_qkv_bias", True)
    x = tokens(4, 16) % 100
    hf = transformers.Qwen2MoeForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = model(x)
        assert relative_error(hf(x).logits, expected) < BOUND
        back = GPT.from_hf(str(tmp_path)).eval()
        assert relative_error(back(x), expected) < BOUND
    for name, p in back.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


def test_a_tp2_moe_checkpoint_exports_as_the_qwen2_moe_its_ranks_trained(tmp_path):
    """megart train at tp2 with sequence parallelism (the shared experts split over the ranks,
    their gates replicated) saves a checkpoint that export-hf writes as a Qwen2-MoE holding the
    ranks' weights, which transformers computes as megart does."""
    flags = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                 disable_bias_linear=True, add_qkv_bias=True, num_experts=4,
                 moe_layer_freq="[1,0,0,1]", moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.01,
                 moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True,
                 tensor_model_parallel_size=2, sequence_parallel=True)  # fmt: skip
    kw = dict(save=str(tmp_path / "ckpt"), train_iters=2, **flags)
    launch(tw.train_kw, 2, kw, timeout=300)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert (written["mlp_only_layers"], written["shared_expert_intermediate_size"]) == ([1, 2], 40)
    ours, whole = mckw.checkpoint_gpt(str(tmp_path / "ckpt"))
    back = GPT.from_hf(str(out))
    for name, value in whole.items():
        got = back.get_parameter("chunk." + name).detach()
        assert torch.equal(got[: value.shape[0]], value.float()), name
    x = tokens(5, 16)
    hf = transformers.Qwen2MoeForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert relative_error(hf(x).logits, back.eval()(x)) < BOUND


def test_import_hf_prints_the_flags_and_pp2_fine_tunes_from_them(tmp_path, capsys):
    """Layers 0 and 3 sparse (the second stage's first layer dense, unlike the first's); the
    import at tp2 holds the pp2 import's whole weights (the shared experts split, their gate
    replicated); pp2 trains from the printed flags with transformers' first loss."""
    hf = saved_qwen2_moe(tmp_path / "hf", mlp_only_layers=[1, 2])
    flags = imported_at_pp2(tmp_path / "hf", tmp_path / "ckpt", capsys)
    printed = " ".join(flags)
    for flag in ("--moe-layer-freq [1,0,0,1]", "--moe-router-pre-softmax", "--add-qkv-bias",
                 "--moe-ffn-hidden-size 24", "--num-experts 4", "--moe-shared-expert-gate",
                 "--moe-shared-expert-intermediate-size 40"):  # fmt: skip
        assert flag in printed, flag
    model = assert_fine_tunes_at_pp2(flags, tmp_path / "ckpt", tmp_path / "hf", hf)
    assert (model["moe_shared_expert_intermediate_size"], model["moe_shared_expert_gate"]) == (
        40, True)  # fmt: skip


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(moe_shared_expert_gate=False), "no --moe-shared-expert-gate .Qwen2-MoE builds"),
        (dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False),
         "no --moe-shared-expert-intermediate-size .Qwen2-MoE builds a shared expert"),
        (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
        (dict(qk_layernorm=True), "Qwen2-MoE checkpoint cannot represent --qk-layernorm"),
    ],
)  # fmt: skip
def test_a_megart_model_qwen2_moe_cannot_represent_is_refused_naming_the_flag(
    tmp_path, changes, named
):
    with pytest.raises(ConfigError, match=named):
        GPT(qwen2_moe(**changes)).save_hf(str(tmp_path), expect="qwen2_moe")
    assert not (tmp_path / "config.json").exists()


def test_ungated_shared_experts_have_no_hugging_face_format(tmp_path):
    cfg = qwen2_moe(moe_shared_expert_gate=False)
    with pytest.raises(ConfigError, match="Qwen2-MoE checkpoint cannot represent no --moe-shared"):
        GPT(cfg).save_hf(str(tmp_path))


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size 0"),
        (dict(use_sliding_window=True, sliding_window=8, layer_types=None),
         "use_sliding_window true without layer_types"),
        (dict(num_experts_per_tok=1, norm_topk_prob=True),
         "num_experts_per_tok 1 with norm_topk_prob true"),
        (dict(decoder_sparse_step=0), "this Qwen2-MoE has decoder_sparse_step 0"),
        (dict(hidden_act="gelu"), "this Qwen2-MoE has hidden_act 'gelu'"),
    ],
)  # fmt: skip
def test_qwen2_moes_megart_cannot_represent_are_refused_naming_what(tmp_path, changes, named):
    transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**HF_TINY)).save_pretrained(
        tmp_path
    )
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConfigError, match=named):
        GPT.from_hf(str(tmp_path))


def test_a_qwen2_moe_without_sparse_layers_loads_as_the_qwen2_it_is(tmp_path):
    hf = saved_qwen2_moe(tmp_path, mlp_only_layers=[0, 1, 2, 3])
    ours = GPT.from_hf(str(tmp_path)).eval()
    assert ours.cfg.num_experts is None and ours.cfg.add_qkv_bias
    x = tokens(6)
    with torch.no_grad():
        assert relative_error(ours(x), hf(x).logits) < BOUND
