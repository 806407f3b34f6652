"""Hugging Face sliding windows: transformers' Mistral (a window W in every layer) and Qwen3
(use_sliding_window with layer_types) as megart's --window-size W-1,0 (and
--window-attn-skip-freq per layer), against transformers 5's own models: logits at tp1 and tp2
with the window shorter than the sequence, the files written back exactly, the train flags
import-hf prints, and training from them."""

import argparse
import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch

import gpt_workers as gw
import train_workers as tw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.training.config import TrainConfig
from megart.training.export_hf import export_checkpoint
from megart.training.import_hf import import_checkpoint
from test_hf_llama import relative_error, rewritten
from test_hf_llama import saved_hf as saved

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

WINDOW = 5  # Hugging Face's sliding_window: each token and the 4 before it
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rope_theta=500000.0)  # fmt: skip
# Qwen3's default from max_window_layers 1: layer 0 full, layers 1-3 windowed.
QWEN3 = dict(TINY, head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
QWEN3_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral")
    config = transformers.MistralConfig(**TINY, sliding_window=WINDOW)
    return root, saved(root, transformers.MistralForCausalLM, config)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return root, saved(root, transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**QWEN3))


def inputs() -> torch.Tensor:
    # 24 tokens: most queries have keys outside the window of 5.
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def logits_with(ours: GPT, x: torch.Tensor, **changes) -> torch.Tensor:
    """The logits of ``ours``'s weights in a model whose config differs by ``changes``."""
    other = GPT(dataclasses.replace(ours.cfg, **changes)).eval()
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        return other(x)


def assert_loads_at_tp1_and_tp2(path: Path, hf: object) -> GPT:
    """megart's model of ``path`` gives ``hf``'s logits at tp1 and tp2 (1e-5 relative, as the
    other HF tests); the same weights without the window, or with a window one token wider,
    do not (what the bound catches)."""
    x = inputs()
    ours = GPT.from_hf(str(path)).eval()
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(ours(x), expected) < 1e-5
    assert relative_error(logits_with(ours, x, window_size=None, window_attn_skip_freq=None),
                          expected) > 1e-3  # fmt: skip
    assert relative_error(logits_with(ours, x, window_size=(WINDOW, 0)), expected) > 1e-4
    for logits in launch(gw.hf_logits, 2, str(path), x, timeout=180):
        assert relative_error(logits, expected) < 1e-5
    return ours


def assert_written_back_exactly(cls: type, hf: object, out: Path, unread: str = "") -> None:
    """``out`` loads in transformers as ``hf``'s config (but for the field ``unread``) and
    weights, bit for bit, and so its logits."""
    back = cls.from_pretrained(out).eval()
    aside = {"_name_or_path": "", unread: ""}  # the directory it was read from
    assert {**back.config.to_dict(), **aside} == {**hf.config.to_dict(), **aside}
    original = hf.state_dict()
    assert back.state_dict().keys() == original.keys()
    for name, value in back.state_dict().items():
        assert torch.equal(value, original[name]), name
    with torch.no_grad():
        assert torch.equal(back(inputs()).logits, hf(inputs()).logits)


def test_a_windowed_mistral_is_window_w_minus_1_at_tp1_and_tp2_and_writes_back(mistral, tmp_path):
    path, hf = mistral
    ours = assert_loads_at_tp1_and_tp2(path, hf)
    assert (ours.cfg.window_size, ours.cfg.window_attn_skip_freq) == ((WINDOW - 1, 0), None)
    launch(gw.hf_export, 2, str(path), str(tmp_path), timeout=180)  # gathered from two shards
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["MistralForCausalLM"]
    assert (written["model_type"], written["sliding_window"]) == ("mistral", WINDOW)
    assert "attention_bias" not in written  # Mistral has no biases, and no field for them
    assert_written_back_exactly(transformers.MistralForCausalLM, hf, tmp_path)


def test_a_qwen3_windowed_from_max_window_layers_is_a_per_layer_window(qwen3, tmp_path):
    path, hf = qwen3
    assert hf.config.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    ours = assert_loads_at_tp1_and_tp2(path, hf)
    assert (ours.cfg.window_size, ours.cfg.window_attn_skip_freq) == ((WINDOW - 1, 0), (0, 1, 1, 1))
    # Layer 0 is the one without the window: windowing it too, or sparing another, is caught.
    for pattern in (None, (1, 0, 1, 1)):
        assert relative_error(logits_with(ours, inputs(), window_attn_skip_freq=pattern),
                              hf(inputs()).logits.detach()) > 1e-4  # fmt: skip
    launch(gw.hf_export, 2, str(path), str(tmp_path), timeout=180)
    written = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((path / "config.json").read_text())
    assert [written[k] for k in QWEN3_FIELDS] == [original[k] for k in QWEN3_FIELDS]
    assert_written_back_exactly(transformers.Qwen3ForCausalLM, hf, tmp_path)


def test_a_qwen3_with_layer_types_reads_them_over_max_window_layers(tmp_path):
    # layer_types (as transformers saves it) wins over max_window_layers, as in Qwen3Config.
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    hf = saved(tmp_path / "hf", transformers.Qwen3ForCausalLM,
               transformers.Qwen3Config(**QWEN3, layer_types=types))  # fmt: skip
    ours = assert_loads_at_tp1_and_tp2(tmp_path / "hf", hf)
    assert ours.cfg.window_attn_skip_freq == (1, 0, 1, 0)
    ours.save_hf(str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["layer_types"] == types and written["max_window_layers"] == 0
    # transformers 5 reads layer_types alone then; megart writes the full layers before the
    # first windowed one (none), not the 1 the original held unread.
    unread = "max_window_layers"
    assert_written_back_exactly(transformers.Qwen3ForCausalLM, hf, tmp_path / "back", unread)


def llama_style(**kw) -> GPTConfig:
    base = dict(vocab_size=100, seq_length=24, hidden_size=32, num_layers=3,
                num_attention_heads=4, ffn_hidden_size=48, normalization="rmsnorm",
                position_embedding="rotary", activation="swiglu", bias=False,
                hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    return GPTConfig(**{**base, **kw})


def randomized(cfg: GPTConfig) -> GPT:
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@pytest.mark.parametrize(
    "kw, cls, model_type",
    [(dict(window_size=(3, 0)), "MistralForCausalLM", "mistral"),
     (dict(window_size=(3, 0), qk_layernorm=True), "Qwen3ForCausalLM", "qwen3"),
     (dict(window_size=(3, 0), window_attn_skip_freq=3, qk_layernorm=True),
      "Qwen3ForCausalLM", "qwen3"),
     (dict(window_size=(3, 0), window_attn_skip_freq=3, add_qkv_bias=True),
      "Qwen2ForCausalLM", "qwen2"),
     (dict(window_size=(-1, 0)), "LlamaForCausalLM", "llama")],  # unbounded: no window
)  # fmt: skip
def test_a_windowed_gpt_is_written_as_mistral_qwen3_or_qwen2(tmp_path, kw, cls, model_type):
    model = randomized(llama_style(**kw))
    model.save_hf(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written["architectures"], written["model_type"]) == ([cls], model_type)
    if model_type != "llama":
        assert written["sliding_window"] == 4  # LEFT 3 and the token itself
    x = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(3))
    hf = getattr(transformers, cls).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert relative_error(hf(x).logits, model(x)) < 1e-5
    back = GPT.from_hf(str(tmp_path))
    layers = range(model.cfg.num_layers)
    assert [back.cfg.layer_window(i) for i in layers] == [model.cfg.layer_window(i) for i in layers]


@pytest.mark.parametrize(
    "kw, named",
    [(dict(window_size=(3, 0), window_attn_skip_freq=2),
      "a Mistral checkpoint cannot represent --window-attn-skip-freq 2 (layers [2]"),
     (dict(window_size=(3, 0), bias=True),
      "a Mistral checkpoint cannot represent no --disable-bias-linear")],
)  # fmt: skip
def test_windowed_gpts_no_format_represents_are_refused_naming_why(tmp_path, kw, named):
    with pytest.raises(ConfigError) as e:
        GPT(llama_style(**kw)).save_hf(str(tmp_path))
    assert named in str(e.value)
    assert "a Llama checkpoint cannot represent --window-size 3,0" in str(e.value)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "which, changes, named",
    [("mistral", dict(sliding_window=0), "sliding_window 0: megart reads a window of at least"),
     ("qwen3", dict(use_sliding_window=False),
      "marks layers sliding_attention in layer_types without a window (use_sliding_window False"),
     ("qwen3", dict(layer_types=["sliding_attention"] * 3), "megart reads one 'sliding_attention'"),
     ("qwen3", dict(layer_types=None, max_window_layers=2, sliding_window=-1),
      "sliding_window -1: megart reads")],
)  # fmt: skip
def test_windows_megart_cannot_read_are_refused_naming_what(
    mistral, qwen3, tmp_path, which, changes, named
):
    path = {"mistral": mistral, "qwen3": qwen3}[which][0]
    with pytest.raises(ConfigError) as e:
        GPT.from_hf(str(rewritten(path, tmp_path / "hf", **changes)))
    assert named in str(e.value)


def test_a_qwen3_without_layer_types_slides_from_max_window_layers_on(qwen3, tmp_path):
    # As transformers before 4.53 saved it: layers max_window_layers (1) and up, from 0.
    path, hf = qwen3
    ours = GPT.from_hf(str(rewritten(path, tmp_path / "hf", layer_types=None))).eval()
    assert ours.cfg.window_attn_skip_freq == (0, 1, 1, 1)
    with torch.no_grad():
        assert relative_error(ours(inputs()), hf(inputs()).logits) < 1e-5


def test_a_qwen3_with_use_sliding_window_false_has_no_window(qwen3, tmp_path):
    # transformers drops the window then, and layer_types computed from it are all full.
    path = rewritten(qwen3[0], tmp_path / "hf", use_sliding_window=False, layer_types=None)
    assert GPT.from_hf(str(path)).cfg.window_size is None


def printed_flags(path: Path, ckpt: Path, capsys) -> list[str]:
    assert megart_main(["import-hf", "--input", str(path), "--save", str(ckpt)]) == 0
    return shlex.split(capsys.readouterr().out.split(f"or with --load {ckpt} ")[1])


def trained_fields(flags: list[str]) -> dict:
    """The TrainConfig fields that megart train ``flags`` set, other than their defaults."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(flags))
    return {k: v for k, v in dataclasses.asdict(config).items() if v != getattr(TrainConfig(), k)}


def test_import_hf_of_a_windowed_mistral_prints_the_window_and_tp2_trains_on_it(
    mistral, tmp_path, capsys
):
    path, hf = mistral
    flags = printed_flags(path, tmp_path / "ckpt", capsys)
    assert flags[flags.index("--window-size") + 1] == f"{WINDOW - 1},0"
    assert "--window-attn-skip-freq" not in flags
    kw = dict(trained_fields(flags), load=str(tmp_path / "ckpt"), train_iters=1,
              lr_warmup_iters=0, seq_length=16, tensor_model_parallel_size=2,
              hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    _, history, (x, targets) = launch(tw.loaded_and_first_step, 2, kw, timeout=300)[0]
    with torch.no_grad():
        logits = hf(x).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert history[0]["loss"] == pytest.approx(want, rel=1e-5)


def test_import_hf_of_a_windowed_qwen3_prints_the_layers_window(qwen3, tmp_path, capsys):
    flags = printed_flags(qwen3[0], tmp_path / "ckpt", capsys)
    built = trained_fields(flags)
    assert (built["window_size"], built["window_attn_skip_freq"]) == (
        f"{WINDOW - 1},0",
        "[0,1,1,1]",
    )
    layers = TrainConfig(**built).gpt_config()
    assert (layers.window_size, layers.window_attn_skip_freq) == ((WINDOW - 1, 0), (0, 1, 1, 1))


@pytest.mark.parametrize("model", ["mistral", "qwen3"])
def test_use_checkpoint_args_takes_the_imported_window(model, request, tmp_path):
    """import-hf says to train with --use-checkpoint-args: it takes the window the printed flags
    give (Megatron-LM's takes neither flag); one given on the command line is kept."""
    from megart.training import checkpoint_args

    path = request.getfixturevalue(model)[0]
    import_checkpoint(path, tmp_path / "ckpt", seq_length=16)
    taken = checkpoint_args.apply({"load": str(tmp_path / "ckpt")}, say=lambda _: None)
    layers = TrainConfig(**{k: v for k, v in taken.items() if k != "load"}).gpt_config()
    skip = None if model == "mistral" else (0, 1, 1, 1)
    assert (layers.window_size, layers.window_attn_skip_freq) == ((WINDOW - 1, 0), skip)
    given = {"load": str(tmp_path / "ckpt"), "window_size": "1,0"}
    assert checkpoint_args.apply(given, say=lambda _: None)["window_size"] == "1,0"


def test_import_then_export_hf_gives_back_the_mistrals_files(mistral, tmp_path):
    path = mistral[0]
    import_checkpoint(path, tmp_path / "ckpt", tp=2)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["sliding_window"] == WINDOW
    original = safetensors.load_file(str(path / "model.safetensors"))
    back = safetensors.load_file(str(out / "model.safetensors"))
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(back[name], value), name
