"""Hugging Face DeepSeek-V3 interop (megart.models.hf_deepseek_v3): multi-latent attention with
plain rope or YaRN, dense first layers, sigmoid-scored experts with the expert bias, group-limited
routing, a shared expert. Against transformers' own DeepseekV3ForCausalLM in float64 (its weights
drawn in float32 and saved as they are): its logits from megart's GPT, megart's files loaded back
by transformers to the same logits and holding the same tensors; import-hf and export-hf through
a megart checkpoint, whose printed flags rebuild the model; a planted mistake caught by the bound;
what either side cannot represent refused by name."""

import dataclasses
import json
import math
import shlex

import pytest
import torch

from megart import ConfigError
from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.models import GPT, GPTConfig
from megart.models import hf_deepseek_v3 as dsv3
from megart.models.hf import read_format, writer
from megart.training.export_hf import export_checkpoint
from megart.training.import_hf import import_for_training
from test_hf_llama import relative_error
from test_hf_mixtral import assert_fine_tunes_at_pp2, imported_at_pp2

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)  # fmt: skip
HF_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               n_shared_experts=2, n_routed_experts=8, kv_lora_rank=12, q_lora_rank=10,
               qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=4, topk_group=2,
               num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=64,
               num_nextn_predict_layers=0, routed_scaling_factor=2.5,
               rope_parameters=YARN)  # fmt: skip
VARIANTS = {
    "yarn-q-lora-groups": {},
    # No query latent, one expert per token (weights unnormalised), every group kept, all
    # layers sparse, tied, plain rope.
    "rope-q-proj-top1-tied": dict(q_lora_rank=None, num_experts_per_tok=1, norm_topk_prob=False,
                                  n_group=1, topk_group=1, first_k_dense_replace=0,
                                  routed_scaling_factor=1.0, tie_word_embeddings=True,
                                  rope_parameters=dict(rope_type="default", rope_theta=500.0)),
    # cos/sin's attention factor 1.2 / 1.03 and the scores' mscale 1.03 squared.
    "yarn-mscales-differ": dict(rope_parameters=dict(YARN, mscale=0.5, mscale_all_dim=0.08)),
    # transformers' default attention factor (0.1 ln 40 + 1) beside a scores' mscale 0.5:
    # megart's --mscale solves for it.
    "yarn-mscale-all-dim-only": dict(rope_parameters={
        k: v for k, v in dict(YARN, mscale_all_dim=0.5).items() if k != "mscale"}),
    "dense": dict(first_k_dense_replace=3),
}  # fmt: skip
# float64 both sides on the same float32-drawn weights; transformers rounds its router (logits,
# sigmoid, weights) and its RMSNorms' normalised values to float32 (its eager attention's
# softmax too): measured 4.9e-7 to 5.7e-7 relative. A wrong mapping is 0.6 or more off
# (test_a_wrong_mapping_fails_the_bound).
BOUND = 1e-5


def saved(root, **changes) -> object:
    """transformers' DeepseekV3ForCausalLM of HF_TINY with ``changes``, every weight and the
    expert biases drawn in float32 (0.3 noise), saved in ``root``; returned in float64."""
    config = transformers.DeepseekV3Config(**{**HF_TINY, **changes},
                                           experts_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    model.save_pretrained(root)
    return model.double().eval()


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_transformers_logits_from_megart_and_back(tmp_path, name):
    hf = saved(tmp_path / "hf", **VARIANTS[name])
    want = logits(hf, TOKENS)
    ours = GPT.from_hf(str(tmp_path / "hf")).double()
    assert relative_error(logits(ours, TOKENS), want) < BOUND
    ours.save_hf(str(tmp_path / "back"))
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(tmp_path / "back"), experts_implementation="eager"
    )
    # The same weights and config in transformers: its own numbers again.
    assert relative_error(logits(back.double().eval(), TOKENS), want) < 1e-12
    written = safetensors.load_file(str(tmp_path / "back" / "model.safetensors"))
    given = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written.keys() == given.keys()
    assert all(torch.equal(written[k], given[k]) for k in given)


def test_the_config_carries_mla_yarn_and_the_routing(tmp_path):
    saved(tmp_path, **VARIANTS["yarn-mscale-all-dim-only"])
    cfg = read_format(tmp_path)[1]
    assert (cfg.multi_latent_attention, cfg.q_lora_rank, cfg.kv_lora_rank) == (True, 10, 12)
    assert (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (8, 4, 6)
    assert cfg.moe_layer_freq == (0, 1, 1) and cfg.moe_shared_expert_intermediate_size == 32
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (4, 2)
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_topk_scaling_factor == 2.5
    # transformers' cos/sin factor 0.1 ln 40 + 1 = mscale(40, m) / mscale(40, 0.5).
    assert cfg.yarn_mscale_all_dim == 0.5
    m = 0.1 * math.log(40.0)
    assert (m * cfg.yarn_mscale + 1) / (0.5 * m + 1) == pytest.approx(m + 1, rel=1e-15)


@pytest.mark.parametrize("mistake", ["rope-rows-deinterleaved", "no-expert-bias", "no-mscale"])
def test_a_wrong_mapping_fails_the_bound(tmp_path, monkeypatch, mistake):
    """Rope rows reordered as if transformers turned halves (what rope_interleave false would
    need), the expert biases left at zero, or the scores' mscale left out (mscale_all_dim read
    as 0, cos/sin's factor kept): transformers' logits leave megart's."""
    hf = saved(tmp_path / "hf", **VARIANTS["yarn-mscales-differ"])
    real_reordered, real_yarn = dsv3._reordered, dsv3._yarn

    def reordered(cfg, ours, w, to_megart):
        w = real_reordered(cfg, ours, w, to_megart)
        pos = cfg.qk_pos_emb_head_dim
        width = {"q_up_proj.weight": cfg.qk_head_dim + pos, "kv_down_proj.weight": None}
        for end, rows in width.items():
            if ours.endswith(end):
                blocks = w.reshape(-1, rows or w.shape[0], w.shape[1]).clone()
                half = torch.arange(pos // 2)
                order = torch.stack([half, half + pos // 2], 1).flatten() + blocks.shape[1] - pos
                blocks[:, -pos:] = blocks[:, order]
                return blocks.reshape(w.shape)
        if mistake == "no-expert-bias" and ours.endswith("expert_bias"):
            return torch.zeros_like(w)
        return w

    def yarn(scaling, hf):
        fields = real_yarn(scaling, hf)
        from megart.models.yarn import yarn_concentration

        c = yarn_concentration(40.0, fields["yarn_mscale"], fields["yarn_mscale_all_dim"])
        return dict(fields, yarn_mscale=(c - 1) / (0.1 * math.log(40.0)),
                    yarn_mscale_all_dim=0.0)  # fmt: skip

    if mistake == "no-mscale":
        monkeypatch.setattr(dsv3, "_yarn", yarn)
    elif mistake == "rope-rows-deinterleaved":
        monkeypatch.setattr(dsv3, "_reordered", reordered)
    else:
        monkeypatch.setattr(
            dsv3, "_reordered", lambda c, o, w, t: reordered(c, o, w, t) if "bias" in o else w
        )
    ours = GPT.from_hf(str(tmp_path / "hf")).double()
    assert relative_error(logits(ours, TOKENS), logits(hf, TOKENS)) > 100 * BOUND


def parse(argv: list[str]):
    p = FlagParser(prog="megart train")
    add_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_import_hf_and_export_hf_through_a_checkpoint(tmp_path):
    """import-hf writes a checkpoint with the expert biases beside the weights; the flags it
    prints build the same model; export-hf writes transformers' files back tensor for tensor."""
    hf = saved(tmp_path / "hf", **VARIANTS["yarn-mscales-differ"])
    said = import_for_training(tmp_path / "hf", tmp_path / "ckpt")
    flags = shlex.split(said.split(f"--load {tmp_path / 'ckpt'} ")[-1])
    cfg = read_format(tmp_path / "hf")[1]
    built = parse(flags).gpt_config()
    # What a run sets (dropout, initialisation), not the model's weights.
    keep = ("seed", "init_std", "make_vocab_size_divisible_by", "hidden_dropout",
            "attention_dropout")  # fmt: skip
    assert dataclasses.replace(built, **{k: getattr(cfg, k) for k in keep}) == cfg
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "back")
    written = safetensors.load_file(str(out / "model.safetensors"))
    given = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written.keys() == given.keys()
    assert all(torch.equal(written[k], given[k]) for k in given)
    assert any("e_score_correction_bias" in k and written[k].abs().sum() > 0 for k in written)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(out), experts_implementation="eager"
    )
    assert relative_error(logits(back.double().eval(), TOKENS), logits(hf, TOKENS)) < 1e-12


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(topk_method="greedy"), "topk_method 'greedy'"),
        (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
        (dict(rope_interleave=False), "rope_interleave false"),
        (dict(norm_topk_prob=False), "norm_topk_prob False with num_experts_per_tok 4"),
        (dict(topk_group=1), "n_group 4 with topk_group 1 and num_experts_per_tok 4"),
        (dict(rms_norm_eps=1e-5), "rms_norm_eps 1e-05"),
        (dict(attention_bias=True), "attention_bias true"),
        (dict(num_key_value_heads=128), "num_key_value_heads 128"),
        (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)),
         "rope scaling .*linear"),
        (dict(n_shared_experts=0), "n_shared_experts 0"),
    ],
)  # fmt: skip
def test_what_megart_cannot_read_is_refused_by_name(tmp_path, change, message):
    config = {**HF_TINY, **change, "model_type": "deepseek_v3"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"this DeepSeek-V3 has .*{message}"):
        read_format(tmp_path)


def test_num_nextn_predict_layers_alone_is_no_depth(tmp_path):
    """Once refused: config.json's num_nextn_predict_layers is read where the files hold the
    layers (tests/test_hf_deepseek_v3_mtp.py); a config without weights holds none."""
    (tmp_path / "config.json").write_text(
        json.dumps({**HF_TINY, "num_nextn_predict_layers": 1, "model_type": "deepseek_v3"})
    )
    assert read_format(tmp_path)[1].mtp_num_layers is None


MLA = dict(vocab_size=64, seq_length=16, hidden_size=32, num_layers=3, num_attention_heads=4,
           ffn_hidden_size=48, normalization="rmsnorm", position_embedding="rotary",
           activation="swiglu", bias=False, qk_layernorm=True, layernorm_epsilon=1e-6,
           multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6)  # fmt: skip
MOE = dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_score_function="sigmoid",
           moe_shared_expert_intermediate_size=32, moe_router_topk=2)  # fmt: skip


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(qk_layernorm=False), "no --qk-layernorm"),
        (dict(layernorm_epsilon=1e-5), "--layernorm-epsilon 1e-05"),
        (dict(MOE, moe_router_score_function="softmax"), "--moe-router-score-function softmax"),
        (dict(MOE, moe_layer_freq=(1, 0, 1)), r"--moe-layer-freq \[1, 0, 1\] .*first ones"),
        (dict(MOE, moe_shared_expert_intermediate_size=None),
         "no --moe-shared-expert-intermediate-size"),
        (dict(MOE, moe_shared_expert_gate=True), "--moe-shared-expert-gate"),
        (dict(MOE, moe_expert_capacity_factor=1.5), "--moe-expert-capacity-factor 1.5"),
        (dict(MOE, num_experts=8, moe_router_topk=3, moe_router_num_groups=2,
              moe_router_group_topk=1), "--moe-router-num-groups 2 --moe-router-group-topk 1"),
    ],
)  # fmt: skip
def test_what_deepseek_v3_cannot_hold_is_refused_by_name(kw, message):
    with pytest.raises(ConfigError, match=f"a DeepSeek-V3 checkpoint cannot represent .*{message}"):
        writer(GPTConfig(**{**MLA, **kw}))


def test_a_dense_mla_model_without_the_expert_bias_is_written_and_read(tmp_path):
    """A megart model without --moe-router-enable-expert-bias writes zero biases (the same
    routing); read back it has the bias, at zero, and the same logits."""
    cfg = GPTConfig(**{**MLA, **MOE, "moe_layer_freq": (0, 1, 1)})
    model = GPT(cfg).double().eval()
    model.save_hf(str(tmp_path))
    back = GPT.from_hf(str(tmp_path)).double()
    assert back.cfg.moe_router_enable_expert_bias
    assert relative_error(logits(back, TOKENS), logits(model, TOKENS)) < 1e-6
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(tmp_path), experts_implementation="eager"
    )
    assert relative_error(logits(hf.double().eval(), TOKENS), logits(model, TOKENS)) < BOUND


def test_an_imported_deepseek_v3_fine_tunes_at_pp2_with_the_printed_flags(tmp_path, capsys):
    """import-hf (at tp2 and at pp2, the same weights), then two pipeline stages train from it
    with the flags it prints: first at transformers' loss on the same batch (so the expert
    biases came through the checkpoint: routing without them differs), then lower."""
    hf = saved(tmp_path / "hf", num_hidden_layers=4, vocab_size=256)  # the corpus's bytes
    flags = imported_at_pp2(tmp_path / "hf", tmp_path / "ckpt", capsys)
    model = assert_fine_tunes_at_pp2(flags, tmp_path / "ckpt", tmp_path / "hf", hf)
    assert model["multi_latent_attention"] and model["moe_router_enable_expert_bias"]
