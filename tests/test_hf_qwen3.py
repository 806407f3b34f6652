"""Hugging Face Qwen3 interop: a Qwen3 is megart's Llama-style GPT with --qk-layernorm. Against
transformers' own Qwen3ForCausalLM: its logits from megart's GPT both ways, its files written
back exactly, and an imported Qwen3 fine-tuned under tensor parallelism with the flags import-hf
prints."""

import json

import pytest
import torch

import gpt_workers as gw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from test_hf_llama import relative_error, saved_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

HF_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=64, rope_theta=1e6, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    """transformers' own Qwen3, norm scales (q_norm and k_norm included) drawn away from 1 so
    that a missing or misplaced norm shows, saved with save_pretrained."""
    root = tmp_path_factory.mktemp("qwen3")
    config = transformers.Qwen3Config(**HF_TINY)
    return root, saved_hf(root, transformers.Qwen3ForCausalLM, config)


def test_a_qwen3_loads_at_tp1_and_tp2_and_writes_back_exactly(hf_qwen3, tmp_path):
    path, hf = hf_qwen3
    ours = GPT.from_hf(str(path)).eval()
    assert ours.cfg.qk_layernorm and not ours.cfg.bias
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(ours(x), expected) < 1e-5
    for logits in launch(gw.hf_logits, 2, str(path), x, timeout=180):
        assert relative_error(logits, expected) < 1e-5
    launch(gw.hf_export, 2, str(path), str(tmp_path), timeout=180)  # gathered from two shards
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["Qwen3ForCausalLM"] and written["model_type"] == "qwen3"
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    for name, value in back.items():
        assert torch.equal(value, original[name]), name


def test_a_zero_centred_qwen3_is_written_with_its_scales(tmp_path):
    cfg = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                    num_attention_heads=4, ffn_hidden_size=48, normalization="rmsnorm",
                    position_embedding="rotary", activation="swiglu", bias=False,
                    qk_layernorm=True, apply_layernorm_1p=True)  # fmt: skip
    model = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    model.save_hf(str(tmp_path))
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert relative_error(hf(x).logits, model(x)) < 1e-5


def test_import_hf_prints_the_flags_and_tp2_fine_tunes_from_it(hf_qwen3, tmp_path, capsys):
    path, _ = hf_qwen3
    assert megart_main(["import-hf", "--input", str(path), "--save", str(tmp_path / "c"),
                        "--seq-length", "16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "--qk-layernorm" in out and "--disable-bias-linear" in out
    import megatron_workers as mw

    flags = out[out.index("--num-layers") :].split("\n")[0].split()
    argv = [*flags, "--load", str(tmp_path / "c"), "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4",
            "--tensor-model-parallel-size", "2"]  # fmt: skip
    status, printed = launch(mw.run_cli, 2, argv, timeout=300)[0]
    assert status == 0, printed


@pytest.mark.parametrize(
    "changes, named",
    [(dict(use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]),
      "marks layers sliding_attention in layer_types without a window"),
     (dict(attention_bias=True), "attention_bias")],
)  # fmt: skip
def test_qwen3s_megart_cannot_represent_are_refused_naming_what(tmp_path, changes, named):
    config = transformers.Qwen3Config(**{**HF_TINY, **changes})
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=named):
        GPT.from_hf(str(tmp_path))
