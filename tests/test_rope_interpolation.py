"""Megatron-LM's --rotary-seq-len-interpolation-factor (position interpolation, Chen et al.
2023): megart's rope angles are Megatron-Core's RotaryEmbedding(seq_len_interpolation_factor)
to the bit and Hugging Face's rope type "linear" to rounding; a transformers Llama with linear
rope loads to its logits and is written back as linear; megart train takes the flag, records it
in its checkpoints and Megatron's args, and refuses what does not fit (no rope, a factor not
above 0, --load of a checkpoint interpolated otherwise, Llama export of both scalings)."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_workers as mw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.rope import rotary
from megart.training import checkpoint
from megart.training.megatron_args import config_from_args, megatron_args

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0"]  # fmt: skip
CPU = torch.device("cpu")


def megatron_core_cos_sin(
    seq: int, dim: int, base: float, factor: float, llama3: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    embeddings = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    rope = embeddings.RotaryEmbedding(
        kv_channels=dim,
        rotary_percent=1.0,
        rotary_base=base,
        seq_len_interpolation_factor=factor,
        rope_scaling=llama3 is not None,
        rope_scaling_factor=llama3 or 8.0,
        use_cpu_initialization=True,
    )
    return rope.get_cos_sin(seq)


def transformers_linear_cos_sin(
    seq: int, dim: int, base: float, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of transformers' Llama rotary embedding with the rope type "linear" (its
    inverse frequencies divided by the factor), [seq, dim/2]: one of the two equal halves."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=dim * 2,
        num_attention_heads=2,
        head_dim=dim,
        rope_parameters=dict(rope_type="linear", factor=factor, rope_theta=base),
    )
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, seq, dim), torch.arange(seq)[None])
    return cos[0, :, : dim // 2], sin[0, :, : dim // 2]


@settings(max_examples=30, deadline=None)
@given(
    dim=st.sampled_from([8, 16, 64, 128, 256]),
    base=st.sampled_from([10000.0, 500000.0, 1e6]),
    factor=st.one_of(st.sampled_from([2.0, 4.0, 8.0, 32.0]), st.floats(1.0, 64.0)),
)
def test_angles_are_megatron_cores_to_the_bit_and_transformers_linear_to_rounding(
    dim, base, factor
):
    seq = 2048
    cos, sin = rotary(seq, dim, CPU, base, None, factor)
    want_cos, want_sin = megatron_core_cos_sin(seq, dim, base, factor)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    # transformers divides the frequencies rather than the positions: the same angles up to
    # an ulp or so of the largest angle, (seq - 1) / factor (measured 1.1e-7 of it).
    hf_cos, hf_sin = transformers_linear_cos_sin(seq, dim, base, factor)
    bound = 4 * 2**-24 * (seq - 1) / factor
    assert (cos - hf_cos).abs().max() <= bound and (sin - hf_sin).abs().max() <= bound


def test_position_f_k_turns_as_k_did_and_both_scalings_apply_as_in_megatron_core():
    plain = rotary(64, 128, CPU, 500000.0)
    cos, sin = rotary(256, 128, CPU, 500000.0, None, 4.0)
    # 4k times 1/4 is k exactly in float32: interpolated position 4k is plain position k.
    assert torch.equal(cos[::4], plain[0]) and torch.equal(sin[::4], plain[1])
    assert (cos[1:4] - plain[0][1:4]).abs().max() > 1e-2  # between them, new angles
    # Megatron-Core applies Llama 3.x's frequency scaling and the interpolation together.
    both = rotary(9000, 128, CPU, 500000.0, 8.0, 4.0)
    want = megatron_core_cos_sin(9000, 128, 500000.0, 4.0, llama3=8.0)
    assert all(torch.equal(a, b) for a, b in zip(both, want, strict=True))
    scaled_only = rotary(9000, 128, CPU, 500000.0, 8.0)
    assert (both[1] - scaled_only[1]).abs().max() > 1e-1


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_transformers_linear_rope_is_the_interpolation_factor_both_ways(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    rope = dict(rope_type="linear", factor=4.0, rope_theta=500000.0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_parameters=rope,
    )
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = GPT.from_hf(str(tmp_path / "hf")).eval()
    assert ours.cfg.rotary_seq_len_interpolation_factor == 4.0 and not ours.cfg.rope_scaling
    x = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(x).logits
        assert relative_error(ours(x), expected) < 1e-5
        plain_cfg = dataclasses.replace(ours.cfg, rotary_seq_len_interpolation_factor=None)
        plain = GPT(plain_cfg).eval()
        plain.load_state_dict(ours.state_dict())
        assert relative_error(plain(x), expected) > 1e-4  # what the bound above catches
    ours.save_hf(str(tmp_path / "back"))
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["rope_parameters"] == rope
    assert written["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert relative_error(back(x).logits, expected) < 1e-5


def llama(**kw: object) -> GPTConfig:
    return GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                     num_attention_heads=4, ffn_hidden_size=48, normalization="rmsnorm",
                     position_embedding="rotary", activation="swiglu", **kw)  # fmt: skip


def test_llama_export_refuses_both_scalings_naming_both_flags(tmp_path):
    both = llama(rope_scaling=True, rotary_seq_len_interpolation_factor=2.0)
    with pytest.raises(ConfigError) as e:
        GPT(both).save_hf(str(tmp_path))
    assert (
        "a Llama checkpoint cannot represent --use-rope-scaling --rope-scaling-factor 8 "
        "together with --rotary-seq-len-interpolation-factor 2" in str(e.value)
    )
    assert not (tmp_path / "config.json").exists()


def test_an_interpolated_llama_trains_saves_and_refuses_another_factor(tmp_path):
    """megart train with --rotary-seq-len-interpolation-factor trains and records the factor;
    --load under another factor (or none) is refused naming the flag."""
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, *LLAMA, "--rotary-seq-len-interpolation-factor", "4",
            "--train-iters", "2", "--save", str(ckpt)]  # fmt: skip
    status, out = launch(mw.run_cli, 1, argv, timeout=300)[0]
    assert status == 0 and "iteration     2/2 |" in out and "loss nan" not in out, out
    state = checkpoint.read_file(ckpt / "iter_0000002" / "mp_rank_00" / checkpoint.FILE)
    assert checkpoint.model_config(state).rotary_seq_len_interpolation_factor == 4.0
    llama_flags = dict(num_layers=2, global_batch_size=4, position_embedding_type="rope",
                       normalization="RMSNorm", swiglu=True)  # fmt: skip
    halves = r"--rotary-base 10000 \(halves\)"
    saved_as = rf"saved with {halves} --rotary-seq-len-interpolation-factor 4 "
    for kw, now in (
        ({}, rf"\(now {halves}\)"),
        ({"rotary_seq_len_interpolation_factor": 2.0}, rf"\(now {halves} --rotary-seq-len-"),
    ):
        config = tw.tiny(**llama_flags, **kw, load=str(ckpt))
        with pytest.raises(ConfigError, match=saved_as + now + ".*cannot be resharded"):
            checkpoint._check_model(ckpt, state, config, config.gpt_config())
    same = tw.tiny(**llama_flags, rotary_seq_len_interpolation_factor=4.0, load=str(ckpt))
    checkpoint._check_model(ckpt, state, same, same.gpt_config())
    # A checkpoint saved before the field existed was not interpolated.
    model = state["model_config"]
    old = {**state, "model_config": {k: v for k, v in model.items() if "interpolation" not in k}}
    assert checkpoint.model_config(old).rotary_seq_len_interpolation_factor is None


def test_megatron_args_record_the_factor_as_megatron_does():
    cfg = llama(rotary_seq_len_interpolation_factor=4.0)
    args = vars(megatron_args(cfg, 5))
    # Megatron-LM's flag is type=int: a whole factor is written as one.
    assert args["rotary_seq_len_interpolation_factor"] == 4
    assert type(args["rotary_seq_len_interpolation_factor"]) is int
    assert config_from_args(args) == cfg
    half = llama(rotary_seq_len_interpolation_factor=2.5)
    assert config_from_args(vars(megatron_args(half, 5))) == half
    # Args from before the flag, or without rope (Megatron ignores it then): none.
    older = {k: v for k, v in args.items() if "interpolation" not in k}
    assert config_from_args(older).rotary_seq_len_interpolation_factor is None
    learned = {**args, "position_embedding_type": "learned_absolute"}
    assert config_from_args(learned).rotary_seq_len_interpolation_factor is None


@pytest.mark.parametrize(
    "flags, match",
    [
        (
            dict(rotary_seq_len_interpolation_factor=4.0),
            "--rotary-seq-len-interpolation-factor .*add --position-embedding-type rope",
        ),
        (
            dict(position_embedding_type="rope", rotary_seq_len_interpolation_factor=0.0),
            "--rotary-seq-len-interpolation-factor 0 .*must be a positive finite number",
        ),
        (
            dict(position_embedding_type="rope", rotary_seq_len_interpolation_factor=-2.0),
            "--rotary-seq-len-interpolation-factor -2 .*must be a positive finite number",
        ),
    ],
)
def test_what_does_not_fit_is_refused_naming_the_flag(flags, match):
    with pytest.raises(ConfigError, match=match):
        tw.tiny(**flags).check(1)


def test_the_cli_refuses_the_factor_without_rope():
    status, out = mw.run_cli([*TINY, "--rotary-seq-len-interpolation-factor", "2",
                              "--train-iters", "1"])  # fmt: skip
    assert status == 2 and "--position-embedding-type rope" in out and "iteration" not in out
