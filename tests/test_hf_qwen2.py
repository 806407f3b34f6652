"""Hugging Face Qwen2 interop: a Qwen2 is megart's Llama-style GPT with --disable-bias-linear
--add-qkv-bias (biases on q_proj, k_proj and v_proj only). Against transformers' own
Qwen2ForCausalLM built from a small random config (nothing downloaded): its logits from
megart's GPT at tp1 and tp2 (grouped-query attention, tied and untied), its files written back
bit for bit, megart's models written as a Qwen2 that transformers computes alike, the formats
that cannot hold a bias on q/k/v alone refusing it by name, and an imported Qwen2 fine-tuned
under tensor parallelism with the flags import-hf prints."""

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt_workers as gw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.training.export_hf import export_checkpoint
from test_hf_llama import relative_error

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

# Four heads sharing two key/value heads.
HF_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rope_theta=1e6, rms_norm_eps=1e-6)  # fmt: skip
QWEN2 = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             bias=False, add_qkv_bias=True)  # fmt: skip


def saved_qwen2(root: Path, **changes) -> object:
    """transformers' own Qwen2ForCausalLM, its q/k/v biases (zero from transformers' init)
    and norm scales drawn, so that a lost, misplaced or misordered bias shows; saved in
    ``root``, returned in eval mode."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**HF_TINY, **changes}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape) * 0.3)
    model.save_pretrained(root)
    return model.eval()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_qwen2(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2")
    return root, saved_qwen2(root, tie_word_embeddings=request.param)


def inputs(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


def test_a_qwen2_loads_at_tp1_and_tp2_and_writes_back_exactly(hf_qwen2, tmp_path):
    path, hf = hf_qwen2
    ours = GPT.from_hf(str(path)).eval()
    cfg = ours.cfg
    assert cfg.add_qkv_bias and not cfg.bias and cfg.query_groups == 2
    assert cfg.untie_embeddings_and_output_weights == (not hf.config.tie_word_embeddings)
    assert [n for n, _ in ours.named_parameters() if n.endswith(".bias")] == [
        f"chunk.blocks.{i}.attn.qkv.bias" for i in range(2)
    ]
    x = inputs()
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(ours(x), expected) < 1e-5
        for block in ours.chunk.blocks:  # what the bound catches: the biases left out
            block.attn.qkv.bias.zero_()
        assert relative_error(ours(x), expected) > 1e-3
    for logits in launch(gw.hf_logits, 2, str(path), x, timeout=180):
        assert relative_error(logits, expected) < 1e-5
    launch(gw.hf_export, 2, str(path), str(tmp_path), timeout=180)  # gathered from two shards
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["Qwen2ForCausalLM"] and written["model_type"] == "qwen2"
    assert "attention_bias" not in written and "mlp_bias" not in written
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    original = hf.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, value in back.state_dict().items():
        assert torch.equal(value, original[name]), name
    with torch.no_grad():
        assert torch.equal(back(x).logits, expected)


def qwen2_shaped(**kw) -> GPTConfig:
    base = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
                ffn_hidden_size=48)  # fmt: skip
    return GPTConfig(**{**base, **QWEN2, **kw})


def drawn(model: GPT, seed: int) -> GPT:
    """Weights far from initialisation (biases included; vocabulary padding zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
            if name in ("chunk.wte.weight", "chunk.output_layer.weight"):
                p[model.cfg.vocab_size :] = 0
    return model.eval()


@settings(max_examples=6, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 4]),
    tied=st.booleans(),
    interleaved=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_a_gpt_with_qkv_bias_alone_is_written_as_transformers_qwen2(
    groups, tied, interleaved, seed
):
    cfg = qwen2_shaped(num_query_groups=None if groups == 4 else groups,
                       untie_embeddings_and_output_weights=not tied,
                       rotary_interleaved=interleaved)  # fmt: skip
    model = drawn(GPT(cfg), seed)
    x = inputs(100)[:, :16]
    with torch.no_grad():
        expected = model(x)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_hf(tmp)
        written = json.loads((Path(tmp) / "config.json").read_text())
        assert written["architectures"] == ["Qwen2ForCausalLM"]
        assert (written["num_key_value_heads"], written["tie_word_embeddings"]) == (groups, tied)
        hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp).eval()
        with torch.no_grad():
            assert relative_error(hf(x).logits, expected) < 1e-5
        back = GPT.from_hf(tmp).eval()
    with torch.no_grad():
        assert relative_error(back(x), expected) < 1e-5
    if not interleaved:  # otherwise the same network stored another way
        for name, p in back.named_parameters():
            assert torch.equal(p, model.get_parameter(name)), name


@pytest.mark.parametrize("fmt, name", [("llama", "Llama"), ("mistral", "Mistral"),
                                       ("qwen3", "Qwen3"), ("gpt2", "GPT-2")])  # fmt: skip
def test_formats_without_a_bias_on_qkv_alone_refuse_it_by_name(tmp_path, fmt, name):
    with pytest.raises(ConfigError) as e:
        GPT(qwen2_shaped()).save_hf(str(tmp_path), expect=fmt)
    assert f"a {name} checkpoint cannot represent" in str(e.value)
    assert "--add-qkv-bias (add_qkv_bias=True" in str(e.value)
    assert not (tmp_path / "config.json").exists()


def test_a_qwen2_holds_qkv_biases_only_and_a_llama_stays_a_llama(tmp_path):
    with pytest.raises(ConfigError, match="a Qwen2 checkpoint cannot represent no --disable-bias"):
        GPT(qwen2_shaped(bias=True)).save_hf(str(tmp_path), expect="qwen2")
    with pytest.raises(ConfigError, match=r"--qk-layernorm \(qk_layernorm=True; Qwen2 has"):
        GPT(qwen2_shaped(qk_layernorm=True)).save_hf(str(tmp_path), expect="qwen2")
    GPT(qwen2_shaped(add_qkv_bias=False)).save_hf(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


WINDOW = 5


def test_a_qwen2_sliding_window_is_qwen3s_per_layer_rule(tmp_path):
    """transformers' Qwen2 windows the layers from max_window_layers on, as its Qwen3: megart's
    --window-size W-1,0 with the per-layer list; the logits agree only with that list."""
    hf = saved_qwen2(tmp_path / "hf", num_hidden_layers=3, use_sliding_window=True,
                     sliding_window=WINDOW, max_window_layers=1)  # fmt: skip
    assert hf.config.layer_types == ["full_attention"] + ["sliding_attention"] * 2
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    assert (ours.cfg.window_size, ours.cfg.window_attn_skip_freq) == ((WINDOW - 1, 0), (0, 1, 1))
    x = inputs()
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(ours(x), expected) < 1e-5
    ours.save_hf(str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["use_sliding_window"], written["sliding_window"]) == (True, WINDOW)
    assert written["layer_types"] == hf.config.layer_types
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(back(x).logits, expected)


def test_import_hf_prints_the_flags_tp2_fine_tunes_and_export_hf_gives_it_back(
    hf_qwen2, tmp_path, capsys
):
    path, hf = hf_qwen2
    ckpt = tmp_path / "c"
    assert megart_main(["import-hf", "--input", str(path), "--save", str(ckpt),
                        "--seq-length", "16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "--disable-bias-linear --add-qkv-bias" in out
    # The imported checkpoint, exported again: transformers reads the original weights.
    export_checkpoint(str(ckpt), str(tmp_path / "hf"), recorded_tokenizer=False)
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert back.keys() == hf.state_dict().keys()
    assert all(torch.equal(v, hf.state_dict()[k]) for k, v in back.items())
    import megatron_workers as mw

    flags = out[out.index("--num-layers") :].split("\n")[0].split()
    argv = [*flags, "--load", str(ckpt), "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4",
            "--tensor-model-parallel-size", "2"]  # fmt: skip
    status, printed = launch(mw.run_cli, 2, argv, timeout=300)[0]
    assert status == 0, printed
