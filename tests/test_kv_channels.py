"""--kv-channels other than --hidden-size / --num-attention-heads (Megatron's flag; Qwen3's
head_dim): heads of that width, the q/k/v projection h -> (heads + 2 groups) x d and the output
projection heads x d -> h. Megatron-Core's GPTModel computes the same logits
(tests/test_megatron_core.py), torch's flop counter the same FLOPs (tests/test_flops.py); here
every layout follows the one-process curve, and transformers' Qwen3 of such heads loads with its
logits and writes back bit for bit."""

import pytest
import torch

import train_workers as tw
from megart import ConfigError
from megart.launcher import launch
from megart.models import GPT

WIDE = dict(kv_channels=16, normalization="RMSNorm", position_embedding_type="rope",
            swiglu=True, group_query_attention=True, num_query_groups=2,
            disable_bias_linear=True, qk_layernorm=True)  # fmt: skip
LAYOUTS = {
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2-interleaved": (
        2,
        dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    ),  # fmt: skip
    "cp2-a2a": (2, dict(context_parallel_size=2, cp_comm_type="a2a")),
    "cp2-p2p-recompute": (2, dict(context_parallel_size=2, recompute_granularity="selective")),
}


@pytest.fixture(scope="module")
def straight():
    return launch(tw.train_kw, 1, dict(WIDE, train_iters=3), timeout=300)[0]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_wide_heads_follow_the_one_process_curve(straight, name):
    nproc, layout = LAYOUTS[name]
    history = launch(tw.train_kw, nproc, dict(WIDE, **layout, train_iters=3), timeout=300)[0]
    want = [h["loss"] for h in straight]
    assert [h["loss"] for h in history] == pytest.approx(want, **tw.SAME_RUN)


def test_the_heads_are_kv_channels_wide_and_the_flag_is_checked():
    cfg = tw.tiny(**WIDE).gpt_config()  # h = 32, 4 heads
    assert (cfg.head_dim, cfg.query_size) == (16, 64)
    shapes = {k: tuple(v.shape) for k, v in GPT(cfg).named_parameters() if ".0.attn." in k}
    assert shapes["chunk.blocks.0.attn.qkv.weight"] == ((4 + 2 * 2) * 16, 32)
    assert shapes["chunk.blocks.0.attn.proj.weight"] == (32, 64)
    assert tw.tiny(kv_channels=8).gpt_config().kv_channels is None  # h / heads: the usual
    # Megatron-LM's rule: without --kv-channels the heads split the hidden size.
    tw.tiny(hidden_size=30, num_attention_heads=4, kv_channels=8).gpt_config()
    with pytest.raises(ConfigError, match="--kv-channels 0: a head is at least 1 wide"):
        tw.tiny(kv_channels=0).gpt_config()
    with pytest.raises(ConfigError, match="--kv-channels 7 is odd"):
        tw.tiny(kv_channels=7, position_embedding_type="rope").gpt_config()


def test_a_qwen3_with_wider_heads_loads_with_transformers_logits_and_writes_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.Qwen3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    assert ours.cfg.kv_channels == 16
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(tokens).logits, ours(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    ours.save_hf(str(tmp_path / "back"))
    original = safetensors.load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = safetensors.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], v) for k, v in original.items())
