"""Hugging Face Llama interop: megart's GPT with RMSNorm, rotary positions and SwiGLU is written
as a LlamaForCausalLM directory and read back, against transformers' own Llama: its logits,
its files, and training from it under tensor and pipeline parallelism."""

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpt_workers as gw
import train_workers as tw
from megart import ConfigError
from megart.cli.main import main as megart_main
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.config import architecture_flags
from megart.models.hf_llama import LLAMA3_FIXED
from megart.training.config import TrainConfig
from megart.training.export_hf import export_checkpoint
from megart.training.import_hf import import_checkpoint, train_flags

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu")
# megart train's flags for the same model, as TrainConfig fields; tiny()'s sizes (h 32, 4 heads,
# 4 layers, the byte vocabulary), two key/value heads and the output layer's own weight.
LLAMA_FLAGS = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    ffn_hidden_size=64,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
HF_TINY = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,  # the checkpoint trains at tiny()'s 16: rope has no table
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, **LLAMA3_FIXED)


def llama(**kw) -> GPTConfig:
    base = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4)
    return GPTConfig(**{**base, "ffn_hidden_size": 48, **LLAMA, **kw})


def randomized(model: GPT, seed: int) -> GPT:
    """Weights far from initialisation (norm scales around 1, biases and vocabulary rows of
    every size), so that a misplaced row changes the logits by much more than rounding."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.3
            is_norm = "ln_" in name
            p.copy_(noise + (1 if is_norm and not model.cfg.apply_layernorm_1p else 0))
            if name in ("chunk.wte.weight", "chunk.output_layer.weight"):
                p[model.cfg.vocab_size :] = 0  # padding stays zero, as megart keeps it
    return model.eval()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def transformers_logits(path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(x).logits


@settings(max_examples=12, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 4]),
    tied=st.booleans(),
    bias=st.booleans(),
    interleaved=st.booleans(),
    one_p=st.booleans(),
    base=st.sampled_from([10000.0, 500000.0]),
    seed=st.integers(0, 1000),
)
def test_a_llama_shaped_gpt_is_written_as_transformers_llama(
    groups, tied, bias, interleaved, one_p, base, seed
):
    cfg = llama(
        num_query_groups=None if groups == 4 else groups,
        untie_embeddings_and_output_weights=not tied,
        bias=bias,
        rotary_interleaved=interleaved,
        apply_layernorm_1p=one_p,
        rotary_base=base,
    )
    model = randomized(GPT(cfg), seed)
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(seed))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_hf(tmp)
        written = json.loads((Path(tmp) / "config.json").read_text())
        assert written["architectures"] == ["LlamaForCausalLM"]
        assert written["num_key_value_heads"] == groups
        assert written["tie_word_embeddings"] == tied
        with torch.no_grad():
            expected = model(x)
        # fp32 on both sides; rotary angles computed in another order: agree to ~1e-7.
        assert relative_error(transformers_logits(tmp, x), expected) < 1e-5
        back = GPT.from_hf(tmp).eval()
        with torch.no_grad():
            assert relative_error(back(x), expected) < 1e-5
    if not (interleaved or one_p):  # otherwise the same network stored another way
        for name, p in back.named_parameters():
            assert torch.equal(p, model.get_parameter(name)), name


def saved_hf(root, cls: type, config: object) -> object:
    """transformers' own randomly initialised ``cls`` with ``config``, its norm scales drawn
    away from 1 (so that a swapped, missing or misplaced norm shows), saved in ``root``;
    returned in eval mode."""
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape) * 0.3)
    model.save_pretrained(root)
    return model.eval()


def saved_llama(root) -> object:
    """transformers' own Llama (GQA, untied, rope base 500000): saved_hf's."""
    return saved_hf(root, transformers.LlamaForCausalLM, transformers.LlamaConfig(**HF_TINY))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return root, saved_llama(root)


def test_transformers_llama_loads_at_tp1_and_tp2_and_writes_back_exactly(hf_llama, tmp_path):
    path, hf = hf_llama
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(GPT.from_hf(str(path)).eval()(x), expected) < 1e-5
    for logits in launch(gw.hf_logits, 2, str(path), x, timeout=180):
        assert relative_error(logits, expected) < 1e-5
    launch(gw.hf_export, 2, str(path), str(tmp_path), timeout=180)  # gathered from two shards
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    for name, value in back.items():
        assert torch.equal(value, original[name]), name


def test_a_parallel_llama_checkpoint_exports_what_its_ranks_trained(tmp_path, capsys):
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    ckpt = tmp_path / "ckpt"
    kw = dict(save=str(ckpt), train_iters=2, **LLAMA_FLAGS, **layout)
    weights = {}
    for rank in launch(tw.weights_after_training, 4, kw, timeout=300):
        weights.update(rank)
    out = tmp_path / "hf"
    assert megart_main(["export-hf", "--load", str(ckpt), "--output", str(out)]) == 0
    assert capsys.readouterr().out == f"{out}: config.json and model.safetensors (Llama)\n"
    back = dict(GPT.from_hf(str(out)).named_parameters())
    assert back.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(back[name].detach()[: value.shape[0]], value), name
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = GPT.from_hf(str(out)).eval()(x)
    assert relative_error(transformers_logits(out, x), ours) < 1e-5


def train_config(argv: list[str]) -> TrainConfig:
    """The TrainConfig that ``megart train ARGV`` runs."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


@pytest.mark.parametrize(
    "target",
    [[], ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]],
    ids=["one-file", "tp2-pp2-files"],  # resharded at load; each rank's own file
)
def test_import_hf_of_a_llama_trains_under_tp2_pp2_with_the_flags_it_prints(
    hf_llama, tmp_path, capsys, target
):
    path, hf = hf_llama
    ckpt = tmp_path / "ckpt"
    assert megart_main(["import-hf", "--input", str(path), "--save", str(ckpt), *target]) == 0
    printed = capsys.readouterr().out
    assert f"train with --load {ckpt} --use-checkpoint-args, or " in printed
    flags = printed.split(f"or with --load {ckpt} ")[1].split()
    # The model as printed (its sizes, RMSNorm, rope base, epsilon, groups, untied, no
    # biases); then this test's run: the layout, and 16 positions where the checkpoint was
    # saved at max_position_embeddings (64), since rotary weights take any length.
    model = {
        k: v
        for k, v in dataclasses.asdict(train_config(flags)).items()
        if v != getattr(TrainConfig(), k)
    }
    assert model["rotary_base"] == 500000 and model["num_query_groups"] == 2
    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    kw = dict(model, load=str(ckpt), train_iters=2, lr_warmup_iters=0, seq_length=16, **layout)
    kw.update(hidden_dropout=0.0, attention_dropout=0.0)
    assert_fine_tunes(launch(tw.loaded_and_first_step, 4, kw, timeout=300), path, hf)


def assert_fine_tunes(runs: list, path, hf: object) -> None:
    """The ranks of train_workers.loaded_and_first_step (``runs``) loaded exactly GPT.from_hf's
    weights of the directory ``path``, trained first at the loss transformers' model ``hf``
    computes on their batch (fp32 on both sides: within 1e-5), and then lower."""
    reference = dict(GPT.from_hf(str(path)).named_parameters())
    merged = {}
    for loaded, _, _ in runs:
        merged.update(loaded)
    assert merged.keys() == reference.keys()
    for name, value in merged.items():
        assert torch.equal(value, reference[name].detach()[: value.shape[0]]), name
    _, history, (inputs, targets) = runs[0]
    with torch.no_grad():
        logits = hf(inputs).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert history[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert history[1]["loss"] < history[0]["loss"]


@settings(max_examples=40, deadline=None)
@given(
    llama_style=st.booleans(),
    groups=st.sampled_from([1, 2, 4]),
    untied=st.booleans(),
    bias=st.booleans(),
    one_p=st.booleans(),
    base=st.sampled_from([10000.0, 500000.0, 1e6]),
    eps=st.sampled_from([1e-5, 1e-6]),
    scaling=st.sampled_from([None, 8.0, 32.0]),
    interpolation=st.sampled_from([None, 2.0, 4.0]),
    head=st.sampled_from([None, 4, 16]),  # --kv-channels (8 is h / heads)
    percent=st.sampled_from([1.0, 0.5]),
    squared_relu=st.booleans(),  # in place of GeLU
)
def test_train_flags_build_the_model_they_were_printed_for(
    llama_style, groups, untied, bias, one_p, base, eps, scaling, interpolation, head, percent,
    squared_relu,
):  # fmt: skip
    kw = LLAMA if llama_style else {"activation": "squared_relu" if squared_relu else "gelu"}
    rope = dict(rotary_base=base, rotary_seq_len_interpolation_factor=interpolation,
                rotary_percent=percent)  # fmt: skip
    if scaling:
        rope.update(rope_scaling=True, rope_scaling_factor=scaling)
    cfg = GPTConfig(
        vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
        ffn_hidden_size=48, num_query_groups=None if groups == 4 else groups,
        untie_embeddings_and_output_weights=untied, bias=bias, apply_layernorm_1p=one_p,
        layernorm_epsilon=eps, kv_channels=head, **kw, **(rope if llama_style else {}),
    )  # fmt: skip
    built = train_config(train_flags(cfg)).gpt_config()
    assert architecture_flags(built) == architecture_flags(cfg)
    sizes = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
    assert [getattr(built, f) for f in sizes] == [getattr(cfg, f) for f in sizes]


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1's and Llama 3.2's
def test_llama3_rope_scaling_is_use_rope_scaling_both_ways(tmp_path, factor):
    rope = dict(rope_type="llama3", factor=factor, rope_theta=500000.0, **LLAMA3_FIXED)
    config = {**HF_TINY, "max_position_embeddings": 16384, "rope_parameters": rope}
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    assert (ours.cfg.rope_scaling, ours.cfg.rope_scaling_factor) == (True, factor)
    # Long enough that the slow frequencies, the ones scaled, turn visibly.
    x = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(ours(x), expected) < 1e-5
        unscaled = GPT(dataclasses.replace(ours.cfg, rope_scaling=False)).eval()
        unscaled.load_state_dict(ours.state_dict())
        assert relative_error(unscaled(x), expected) > 1e-4  # what the bound above catches
    ours.save_hf(str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["rope_parameters"] == rope and written["rope_scaling"]["factor"] == factor
    assert relative_error(transformers_logits(tmp_path / "back", x), expected) < 1e-5


def test_a_mistral_without_a_sliding_window_loads_as_the_llama_it_is(tmp_path):
    config = transformers.MistralConfig(**HF_TINY, sliding_window=None)
    torch.manual_seed(3)
    hf = transformers.MistralForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "mistral")
    ours = GPT.from_hf(str(tmp_path / "mistral")).eval()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert relative_error(ours(x), hf(x).logits) < 1e-5


def test_a_model_neither_format_represents_is_refused_naming_both(tmp_path):
    cfg = llama(normalization="layernorm")
    with pytest.raises(ConfigError) as e:
        GPT(cfg).save_hf(str(tmp_path))
    message = str(e.value)
    assert "a GPT-2 checkpoint cannot represent" in message
    assert (
        "a Llama checkpoint cannot represent --normalization LayerNorm "
        "(normalization='layernorm'; Llama has 'rmsnorm')" in message
    )
    # GPT-2 only, when asked for GPT-2: the Llama-shaped model is refused without a word of Llama.
    with pytest.raises(ConfigError, match="GPT-2 checkpoint cannot represent") as e:
        GPT(llama()).save_hf_gpt2(str(tmp_path))
    assert "Llama" not in str(e.value)
    assert not (tmp_path / "config.json").exists()


def rewritten(path: Path, to: Path, **changes) -> Path:
    """A copy of the Llama directory ``path`` with config.json's ``changes``."""
    to.mkdir()
    (to / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    config = json.loads((path / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, **changes}))
    return to


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model_type": "phi3"}, "type 'phi3'; megart reads gpt2, llama, mistral, qwen2, qwen3"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias True with mlp_bias False"),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "rope scaling {'rope_type': 'dynamic', 'factor': 2.0} (megart's --use-rope-scaling",
        ),
        (  # llama3 with constants other than Llama 3.x's (and Megatron-Core's)
            {"rope_scaling": dict(LLAMA3_SCALING, original_max_position_embeddings=4096)},
            "'original_max_position_embeddings': 4096} (megart's --use-rope-scaling",
        ),
    ],
)
def test_llamas_megart_cannot_represent_are_refused_naming_what(hf_llama, tmp_path, changes, named):
    src = rewritten(hf_llama[0], tmp_path / "hf", **changes)
    with pytest.raises(ConfigError) as e:
        GPT.from_hf(str(src))
    assert named in str(e.value)


def test_missing_tensors_and_other_formats_are_named(hf_llama, tmp_path, capsys):
    path = hf_llama[0]
    with pytest.raises(ConfigError, match="holds a model of type 'llama'; megart reads gpt2 "):
        GPT.from_hf_gpt2(str(path))
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text((path / "config.json").read_text())
    tensors = safetensors.load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.save_file(tensors, str(cut / "model.safetensors"))
    with pytest.raises(ConfigError, match="no file holds model.layers.1.mlp.up_proj.weight"):
        GPT.from_hf(str(cut))
    argv = ["import-hf", "--input", str(path), "--save", str(tmp_path / "c"), "--seq-length", "0"]
    assert megart_main(argv) == 2
    err = capsys.readouterr().err
    assert "has rotary positions; give a positive length" in err and err.count("\n") == 1


def test_convert_from_hf_to_megart_is_import_hf(hf_llama, tmp_path, capsys):
    args = ["--input", str(hf_llama[0]), "--save", str(tmp_path / "a")]
    assert megart_main(["import-hf", *args]) == 0
    imported = capsys.readouterr().out
    args = ["--from", "hf", "--to", "megart", "--load", str(hf_llama[0])]
    assert megart_main(["convert-checkpoint", *args, "--save", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out == imported.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    a, b = (tmp_path / d / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt" for d in "ab")
    assert a.read_bytes() == b.read_bytes()


def test_import_then_export_gives_back_the_files_at_the_length_asked_for(hf_llama, tmp_path):
    path = hf_llama[0]
    import_checkpoint(path, tmp_path / "ckpt", seq_length=4096)  # past 64: rope has no table
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 4096
    original = safetensors.load_file(str(path / "model.safetensors"))
    back = safetensors.load_file(str(out / "model.safetensors"))
    assert back.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(back[name], value), name
