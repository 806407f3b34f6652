"""megart's GPT against Megatron-Core's own GPTModel (megatron-core 0.16.1 from the package
index, local transformer spec, CPU, float64): Megatron-Core loads megart's weights strictly
(names mapped by megart.models.megatron_names) and computes the same logits, and megart loads a
Megatron-Core model's weights and computes its logits, for GPT-2-style and Llama-style models
(RMSNorm, rope rotating halves or, with --rotary-interleaved, adjacent pairs, SwiGLU, GQA,
untied output layer, --use-rope-scaling, --rotary-seq-len-interpolation-factor, --rotary-percent
0.5, --position-embedding-type yarn), and with
--apply-layernorm-1p (zero-centred LayerNorm weights), --kv-channels other than h / heads and
--squared-relu."""

import pytest

import megatron_core_ckpt_workers as mckw
import megatron_core_workers as mcw
import train_workers as tw
from megart.launcher import launch

BASE = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4)
LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=64, bias=False, untie_embeddings_and_output_weights=True,
             num_query_groups=2)  # fmt: skip
CONFIGS = {
    "gpt2": {},
    "llama": LLAMA,
    "llama-interleaved-mqa": {**LLAMA, "rotary_interleaved": True, "num_query_groups": 1},
    "rope-gelu-tied-base-500": dict(position_embedding="rotary", rotary_base=500.0),
    # --use-rope-scaling: a base and head size whose slow frequencies the factor divides.
    "llama-rope-scaling": {
        **LLAMA,
        "rotary_base": 1e6,
        "rope_scaling": True,
        "rope_scaling_factor": 4.0,
    },
    # --rotary-seq-len-interpolation-factor: every position divided by 4 before it turns.
    "llama-interpolated": {**LLAMA, "rotary_seq_len_interpolation_factor": 4.0},
    # --position-embedding-type yarn: heads of 16 (8 pairs) whose correction range blends a
    # few pairs (original context 64, factor 4); its concentration factor multiplies cos and
    # sin of the queries and keys. Then non-default betas, mscales and unrounded range ends.
    "llama-yarn": {
        **LLAMA,
        "kv_channels": 16,
        "rope_type": "yarn",
        "yarn_rotary_scaling_factor": 4.0,
        "yarn_original_max_position_embeddings": 64,
    },
    "llama-yarn-settings": {
        **LLAMA,
        "kv_channels": 16,
        "rotary_base": 500.0,
        "rope_type": "yarn",
        "yarn_rotary_scaling_factor": 6.5,
        "yarn_original_max_position_embeddings": 40,
        "yarn_beta_fast": 8.0,
        "yarn_beta_slow": 2.0,
        "yarn_mscale": 1.3,
        "yarn_mscale_all_dim": 0.4,
        "yarn_correction_range_round_to_int": False,
    },
    # --rotary-percent 0.5: the first 4 channels of each head of 8 turn (see test_rotary_percent).
    "llama-partial-rotary": {**LLAMA, "rotary_percent": 0.5},
    # Its FusedLayerNorm with zero-centred gamma (apex's kernel replaced by torch's function).
    "gpt2-layernorm-1p": dict(apply_layernorm_1p=True),
    # --kv-channels: heads of 16 on a hidden size of 32 (Qwen3's kind), and narrower ones.
    "llama-wide-heads": {**LLAMA, "kv_channels": 16, "qk_layernorm": True},
    "gpt2-narrow-heads": dict(kv_channels=4),
    # --squared-relu: with biases, and Nemotron's mix (zero-centred LayerNorm, half the head
    # turning, no biases, untied).
    "gpt2-squared-relu": dict(activation="squared_relu"),
    "nemotron-style": dict(
        activation="squared_relu",
        apply_layernorm_1p=True,
        bias=False,
        position_embedding="rotary",
        rotary_percent=0.5,
        num_query_groups=2,
        untie_embeddings_and_output_weights=True,
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def results():
    configs = [{**BASE, **kw} for kw in CONFIGS.values()]
    return dict(zip(CONFIGS, launch(mcw.compare_all, 1, configs, timeout=300)[0], strict=True))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_megatron_core_computes_megarts_logits_both_ways(results, name):
    r = results[name]
    assert r["scale"] > 0.1  # logits of some size, not all zero
    assert r["forward"] < 1e-5  # megart's weights in Megatron-Core's GPTModel
    assert r["reverse"] < 1e-5  # Megatron-Core's weights in megart's GPT


def test_megatron_core_scales_rope_as_megart_does(results):
    """Over 16 positions the scaling moves these logits by little: megart's rope left unscaled
    differs from Megatron-Core's scaled one by 2e-6, where the two agree to 6e-11 (measured),
    so the bound here is tighter than the one above."""
    r = results["llama-rope-scaling"]
    assert r["forward"] < 1e-8 and r["reverse"] < 1e-8


def test_megatron_core_interpolates_rope_positions_as_megart_does(results):
    """The same tight bound: with megart's positions left undivided the two differ by 7e-4
    (measured)."""
    r = results["llama-interpolated"]
    assert r["forward"] < 1e-8 and r["reverse"] < 1e-8


def test_megart_checkpoints_convert_to_megatrons_legacy_format_and_back(tmp_path):
    """A tp2 Llama-style run's checkpoint, converted to Megatron-LM's legacy checkpoint:
    Megatron-Core's GPTModel loads it strictly and computes the same logits; converted back,
    the weights and the model config are the original ones."""
    llama = {
        "normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True,
        "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
        "group_query_attention": True, "num_query_groups": 2, "num_layers": 2,
    }  # fmt: skip
    ckpt = tmp_path / "ckpt"
    launch(tw.train_kw, 2, {**llama, "train_iters": 1, "save": str(ckpt),
                       "tensor_model_parallel_size": 2}, timeout=300)  # fmt: skip
    r = launch(mckw.legacy_checkpoint_roundtrip, 1, str(ckpt), str(tmp_path), timeout=300)[0]
    assert r["logits"] < 1e-5 and r["iteration"] == 1
    assert r["same_weights"] and r["same_config"]
    # --load of the Megatron-LM checkpoint, under another layout, is --finetune of the original.
    tuned = launch(tw.train_kw, 1, {**llama, "load": str(ckpt), "finetune": True}, timeout=300)[0]
    megatron = str(tmp_path / "megatron")
    tp2 = {**llama, "load": megatron, "tensor_model_parallel_size": 2}
    for history in launch(tw.train_kw, 2, tp2, timeout=300):
        assert history[0]["loss"] == pytest.approx(tuned[0]["loss"], rel=1e-5)


@pytest.mark.parametrize("name", ["llama-yarn", "llama-yarn-settings"])
def test_megatron_core_turns_yarn_as_megart_does(results, name):
    """YaRN's frequencies and concentration factor are Megatron-Core's to the bit (its cos and
    sin, tests/test_yarn.py), so the logits agree as plain rope's do (measured: below 1e-14);
    megart's plain rope in their place differs by over 0.1 (its concentration alone scales the
    logits by 1.3)."""
    r = results[name]
    assert r["forward"] < 1e-10 and r["reverse"] < 1e-10
