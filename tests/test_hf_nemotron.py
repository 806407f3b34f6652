"""Hugging Face Nemotron interop (Nemotron-4, Minitron): megart's GPT with --squared-relu,
--apply-layernorm-1p and rope on --rotary-percent of each head. Against transformers' own
NemotronForCausalLM: its logits from megart's GPT at tp1 and tp2, its files written back
exactly, a megart model written in its format, what either side cannot represent refused by
name, and an imported Nemotron fine-tuned under tensor parallelism with the flags import-hf
prints."""

import json

import pytest
import torch

import gpt_workers as gw
import megatron_workers as mw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from test_hf_llama import relative_error

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors.torch")

# Half of each head turning (Nemotron's default), grouped queries, untied.
HF_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=64, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.5})  # fmt: skip
VARIANTS = {
    "gqa-untied": {},
    # Biases on every linear layer, heads 16 wide on h 32 (--kv-channels), tied, a quarter turning.
    "biased-wide-heads-tied": dict(attention_bias=True, mlp_bias=True, head_dim=16,
                                   num_key_value_heads=4, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                    "partial_rotary_factor": 0.25}),
}  # fmt: skip


def saved_nemotron(root, **changes) -> object:
    """transformers' own Nemotron, every norm weight and bias and every linear bias drawn
    away from its initial value (so that a swapped, missing or misplaced one shows), saved."""
    torch.manual_seed(0)
    model = transformers.NemotronForCausalLM(transformers.NemotronConfig(**{**HF_TINY, **changes}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape) * 0.3)
    model.save_pretrained(root)
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_nemotron_loads_at_tp1_and_tp2_and_writes_back_exactly(tmp_path, variant):
    hf = saved_nemotron(tmp_path / "hf", **VARIANTS[variant])
    path = str(tmp_path / "hf")
    ours = GPT.from_hf(path).eval()
    assert (ours.cfg.activation, ours.cfg.apply_layernorm_1p) == ("squared_relu", True)
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(ours(x), expected) < 1e-5
    for logits in launch(gw.hf_logits, 2, path, x, timeout=180):
        assert relative_error(logits, expected) < 1e-5
    out = tmp_path / "back"
    launch(gw.hf_export, 2, path, str(out), timeout=180)  # gathered from two shards
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["NemotronForCausalLM"]
    back = transformers.NemotronForCausalLM.from_pretrained(out).state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    for name, value in back.items():
        assert torch.equal(value, original[name]), name


def test_a_megart_model_with_nemotrons_options_is_written_as_one(tmp_path):
    cfg = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                    num_attention_heads=4, ffn_hidden_size=48, activation="squared_relu",
                    apply_layernorm_1p=True, position_embedding="rotary", rotary_percent=0.5,
                    bias=False, untie_embeddings_and_output_weights=True)  # fmt: skip
    model = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    model.save_hf(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "nemotron"
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    hf = transformers.NemotronForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert relative_error(hf(x).logits, model(x)) < 1e-5


@pytest.mark.parametrize(
    "changes,named",
    [
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(attention_bias=True), "attention_bias True with mlp_bias False"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                               "partial_rotary_factor": 0.5}), "rope type 'linear'"),
    ],
)  # fmt: skip
def test_nemotrons_megart_cannot_represent_are_refused_naming_what(tmp_path, changes, named):
    saved_nemotron(tmp_path, **changes)
    with pytest.raises(ConfigError, match=named):
        GPT.from_hf(str(tmp_path))


def test_a_megart_model_nemotron_cannot_represent_is_refused_naming_the_flags(tmp_path):
    cfg = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                    num_attention_heads=4, activation="squared_relu", apply_layernorm_1p=True,
                    position_embedding="rotary", rotary_interleaved=True)  # fmt: skip
    with pytest.raises(ConfigError, match="Nemotron checkpoint cannot represent --rotary-base "
                       "10000 --rotary-interleaved"):  # fmt: skip
        GPT(cfg).save_hf(str(tmp_path), expect="nemotron")
    with pytest.raises(ConfigError, match="--normalization RMSNorm .*Nemotron has 'layernorm'"):
        GPT(
            GPTConfig(
                **{
                    **cfg.__dict__,
                    "normalization": "rmsnorm",
                    "rotary_interleaved": False,
                    "fused_layer_norm": False,
                }
            )
        ).save_hf(str(tmp_path), expect="nemotron")


def test_import_hf_prints_the_flags_and_tp2_fine_tunes_from_it(tmp_path, capsys):
    saved_nemotron(tmp_path / "hf", **VARIANTS["biased-wide-heads-tied"])
    assert megart_main(["import-hf", "--input", str(tmp_path / "hf"), "--save",
                        str(tmp_path / "c"), "--seq-length", "16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    flags = out[out.index("--num-layers") :].split("\n")[0].split()
    for flag in ("--squared-relu", "--apply-layernorm-1p", "--kv-channels", "--rotary-percent"):
        assert flag in flags, flag
    argv = [*flags, "--load", str(tmp_path / "c"), "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4",
            "--tensor-model-parallel-size", "2"]  # fmt: skip
    status, printed = launch(mw.run_cli, 2, argv, timeout=300)[0]
    assert status == 0, printed
