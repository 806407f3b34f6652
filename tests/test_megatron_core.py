"""megart's GPT against Megatron-Core's own GPTModel (megatron-core 0.16.1 from the package
index, local transformer spec, CPU, float64): Megatron-Core loads megart's weights strictly
(names mapped by megart.models.megatron_names) and computes the same logits, and megart loads a
Megatron-Core model's weights and computes its logits, for GPT-2-style and Llama-style models
(RMSNorm, rope rotating halves or, with --rotary-interleaved, adjacent pairs, SwiGLU, GQA,
untied output layer)."""

import pytest

import megatron_core_workers as mcw
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
