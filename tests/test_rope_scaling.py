"""Megatron-LM's --use-rope-scaling --rope-scaling-factor (Llama 3.x's rope frequency scaling):
megart's scaled inverse frequencies are Hugging Face's rope type "llama3" and Megatron-Core's
RotaryEmbedding(rope_scaling=True); fast frequencies are kept and slow ones divided; megart
train takes the flags, records them in its checkpoints and Megatron's args, and refuses what
does not fit (no rope, a factor below 1, --load of a checkpoint scaled otherwise).
(tests/test_megatron_core.py also runs a whole scaled Llama-style model against
Megatron-Core's GPTModel.)"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_workers as mw
import train_workers as tw
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models import GPTConfig
from megart.models.rope import llama3_inv_freq, rotary
from megart.training import checkpoint
from megart.training.megatron_args import config_from_args, megatron_args

LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0"]  # fmt: skip


def inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs() / b.double().abs()).max().item()


def transformers_llama3(dim: int, base: float, factor: float) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=dim * 2,
        num_attention_heads=2,
        head_dim=dim,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=base,
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]


def megatron_core_scaled(dim: int, base: float, factor: float) -> torch.Tensor:
    embeddings = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    rope = embeddings.RotaryEmbedding(
        kv_channels=dim,
        rotary_percent=1.0,
        rotary_base=base,
        rope_scaling=True,
        rope_scaling_factor=factor,
        use_cpu_initialization=True,
    )
    return rope.inv_freq


@settings(max_examples=40, deadline=None)
@given(
    dim=st.sampled_from([8, 16, 64, 96, 128, 256]),
    base=st.sampled_from([10000.0, 500000.0, 1e6]),
    factor=st.one_of(st.sampled_from([1.0, 8.0, 32.0]), st.floats(1.0, 64.0)),
)
def test_scaled_frequencies_are_transformers_llama3_and_megatron_cores(dim, base, factor):
    scaled = llama3_inv_freq(inv_freq(dim, base), factor)
    assert relative(scaled, transformers_llama3(dim, base, factor)) < 1e-6
    assert relative(scaled, megatron_core_scaled(dim, base, factor)) < 1e-6
    # rotary() turns position p by p times those frequencies.
    cos, sin = rotary(3, dim, torch.device("cpu"), base, factor)
    assert torch.allclose(cos[2], torch.cos(2 * scaled), rtol=0, atol=1e-6)
    assert torch.allclose(sin[2], torch.sin(2 * scaled), rtol=0, atol=1e-6)


def test_fast_frequencies_are_kept_slow_ones_divided_and_the_band_between_blended():
    """Llama 3.1's head (128, base 500000, factor 8): every frequency turning more than 4 times
    over the original 8192 positions (wavelength below 2048) is unchanged, every one turning
    less than once (above 8192) divided by 8, and those between lie strictly between the two."""
    inv, factor = inv_freq(128, 500000.0), 8.0
    scaled = llama3_inv_freq(inv, factor)
    wavelength = 2 * math.pi / inv
    fast, slow = wavelength < 8192 / 4, wavelength > 8192 / 1
    band = ~fast & ~slow
    assert fast.sum() > 10 and slow.sum() > 10 and band.sum() >= 3
    assert torch.equal(scaled[fast], inv[fast])
    assert torch.allclose(scaled[slow], inv[slow] / factor, rtol=1e-7, atol=0)
    assert (scaled[band] < inv[band]).all() and (scaled[band] > inv[band] / factor).all()
    # Continuous at both edges of the band, and monotone: the blend neither jumps nor folds.
    assert (scaled[1:] < scaled[:-1]).all()
    # The factor 1 scales nothing; without a factor rotary() is unscaled rope.
    assert torch.equal(llama3_inv_freq(inv, 1.0), inv)
    plain = rotary(9000, 128, torch.device("cpu"), 500000.0)
    same = rotary(9000, 128, torch.device("cpu"), 500000.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, same, strict=True))
    # Scaled, the slow pairs turn 8 times slower: late positions' angles move.
    cos, sin = rotary(9000, 128, torch.device("cpu"), 500000.0, factor)
    assert torch.equal(cos[:, :10], plain[0][:, :10])  # the fastest pairs are untouched
    assert sin[-1, -1].item() == pytest.approx(math.sin(8999 * inv[-1].item() / 8), rel=1e-4)
    assert (sin[-1, -1] - plain[1][-1, -1]).abs() > 1e-2


def test_a_rope_scaled_llama_trains_saves_and_refuses_another_scaling(tmp_path):
    """megart train with --use-rope-scaling trains and records the scaling; --load under
    another scaling (none, or another factor) is refused naming the flags."""
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, *LLAMA, "--use-rope-scaling", "--rope-scaling-factor", "4",
            "--train-iters", "2", "--save", str(ckpt)]  # fmt: skip
    status, out = launch(mw.run_cli, 1, argv, timeout=300)[0]
    assert status == 0 and "iteration     2/2 |" in out and "loss nan" not in out, out
    state = checkpoint.read_file(ckpt / "iter_0000002" / "mp_rank_00" / checkpoint.FILE)
    saved = checkpoint.model_config(state)
    assert saved.rope_scaling and saved.rope_scaling_factor == 4.0
    llama = dict(num_layers=2, global_batch_size=4, position_embedding_type="rope",
                 normalization="RMSNorm", swiglu=True)  # fmt: skip
    halves = r"--rotary-base 10000 \(halves\)"
    saved_as = rf"saved with {halves} --use-rope-scaling --rope-scaling-factor 4 "
    for kw, now in (
        ({}, rf"\(now {halves}\)"),  # no scaling
        (
            {"use_rope_scaling": True},
            rf"\(now {halves} --use-rope-scaling --rope-scaling-factor 8\)",
        ),
    ):
        config = tw.tiny(**llama, **kw, load=str(ckpt))
        with pytest.raises(ConfigError, match=saved_as + now + ".*cannot be resharded"):
            checkpoint._check_model(ckpt, state, config, config.gpt_config())
    same = tw.tiny(**llama, use_rope_scaling=True, rope_scaling_factor=4.0, load=str(ckpt))
    checkpoint._check_model(ckpt, state, same, same.gpt_config())
    # A checkpoint saved before the fields existed is unscaled, which is what it was.
    old = {**state, "model_config": {k: v for k, v in state["model_config"].items()
                                     if not k.startswith("rope_scaling")}}  # fmt: skip
    assert not checkpoint.model_config(old).rope_scaling
    plain = tw.tiny(**llama, load=str(ckpt))
    checkpoint._check_model(ckpt, old, plain, plain.gpt_config())


def test_megatron_args_record_the_scaling_as_megatron_does():
    scaled = GPTConfig(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2,
                       num_attention_heads=4, ffn_hidden_size=128, position_embedding="rotary",
                       rope_scaling=True, rope_scaling_factor=32.0)  # fmt: skip
    args = vars(megatron_args(scaled, 5))
    assert args["use_rope_scaling"] is True and args["rope_scaling_factor"] == 32.0
    assert config_from_args(args) == scaled
    # Megatron-LM's args from before the flags: no scaling; with --use-rope-scaling but no
    # factor recorded (Megatron-Core's fixed 8 then): 8; without rope Megatron ignores it.
    older = {k: v for k, v in args.items() if "rope_scaling" not in k}
    assert not config_from_args(older).rope_scaling
    assert config_from_args({**older, "use_rope_scaling": True}).rope_scaling_factor == 8.0
    learned = {**args, "position_embedding_type": "learned_absolute"}
    assert not config_from_args(learned).rope_scaling


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(use_rope_scaling=True), "--use-rope-scaling .*add --position-embedding-type rope"),
        (
            dict(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=0.5),
            "--rope-scaling-factor 0.5 .*must be at least 1",
        ),
        (
            dict(position_embedding_type="rope", rope_scaling_factor=4.0),
            "--rope-scaling-factor 4 scales rope only with --use-rope-scaling: add it",
        ),
    ],
)
def test_what_does_not_fit_is_refused_naming_the_flags(flags, match):
    with pytest.raises(ConfigError, match=match):
        tw.tiny(**flags).check(1)


def test_the_cli_refuses_use_rope_scaling_without_rope():
    status, out = mw.run_cli([*TINY, "--use-rope-scaling", "--train-iters", "1"])
    assert status == 2 and "--position-embedding-type rope" in out and "iteration" not in out
