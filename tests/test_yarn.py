"""YaRN (Megatron-LM's --position-embedding-type yarn; Hugging Face's rope type "yarn"): megart's
cos and sin are Megatron-Core's YarnRotaryEmbedding's (times its concentration factor, as its
attention multiplies them) and transformers' "yarn" frequencies and attention factor, to the
bit, over heads, bases, factors, contexts, betas, mscales and rounding; the frequencies are
kept before the correction range, divided after it and blended inside; GPTConfig refuses
what cannot apply. (tests/test_megatron_core.py runs whole YaRN models against Megatron-Core's
GPTModel; tests/test_yarn_flags.py the flags, checkpoints and layouts; tests/test_hf_yarn.py
transformers' models.)"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.errors import ConfigError
from megart.models import GPTConfig
from megart.models.hf_yarn import hf_yarn, yarn_from_hf
from megart.models.rope import rotary
from megart.models.yarn import correction_range, yarn_concentration, yarn_inv_freq

CPU = torch.device("cpu")


def yarn_config(dim: int, base: float = 10000.0, **yarn: object) -> GPTConfig:
    return GPTConfig(vocab_size=10, seq_length=8, hidden_size=2 * dim, num_layers=1,
                     num_attention_heads=2, position_embedding="rotary", rotary_base=base,
                     rope_type="yarn", **yarn)  # fmt: skip


def megatron_core_cos_sin(cfg: GPTConfig, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-Core's YarnRotaryEmbedding's angles, cos and sin times the concentration factor
    it returns beside them (what its attention's apply_rotary_pos_emb multiplies), [seq, d/2]:
    one of the two equal halves."""
    yarn = pytest.importorskip("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    # It moves its frequencies to "the current CUDA device" when called: here the CPU.
    real, torch.cuda.current_device = torch.cuda.current_device, lambda: "cpu"
    try:
        rope = yarn.YarnRotaryEmbedding(
            cfg.head_dim,
            rotary_base=cfg.rotary_base,
            use_cpu_initialization=True,
            scaling_factor=cfg.yarn_rotary_scaling_factor,
            original_max_position_embeddings=cfg.yarn_original_max_position_embeddings,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
            mscale=cfg.yarn_mscale,
            mscale_all_dim=cfg.yarn_mscale_all_dim,
            correction_range_round_to_int=cfg.yarn_correction_range_round_to_int,
        )
        emb, mscale = rope(seq)
    finally:
        torch.cuda.current_device = real
    half = emb[:, 0, 0, : cfg.head_dim // 2]
    assert torch.equal(half, emb[:, 0, 0, cfg.head_dim // 2 :])
    return half.cos() * mscale, half.sin() * mscale


def transformers_yarn(cfg: GPTConfig) -> tuple[torch.Tensor, float]:
    """transformers' "yarn" inverse frequencies and attention factor for the rope scaling
    megart writes for ``cfg`` (megart.models.hf_yarn.hf_yarn)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.seq_length,
        rope_parameters={**hf_yarn(cfg), "rope_theta": cfg.rotary_base},
    )
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


SETTINGS = dict(
    dim=st.sampled_from([8, 16, 64, 96, 128]),
    base=st.sampled_from([10000.0, 500000.0, 1e6]),
    factor=st.one_of(st.sampled_from([1.0, 4.0, 40.0]), st.floats(1.0, 64.0)),
    original=st.sampled_from([16, 64, 4096, 32768]),
    betas=st.one_of(
        st.just((32.0, 1.0)),
        st.tuples(st.floats(0.5, 64.0), st.floats(0.05, 8.0)).filter(lambda b: b[1] < b[0]),
    ),
    mscales=st.one_of(
        st.just((1.0, 0.0)),
        st.just((0.707, 0.707)),  # DeepSeek-V3's: a concentration of 1
        st.tuples(st.floats(0.0, 2.0), st.floats(0.0, 2.0)),
    ),
    round_to_int=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(**SETTINGS)
def test_cos_and_sin_are_megatron_cores_and_transformers_to_the_bit(
    dim, base, factor, original, betas, mscales, round_to_int
):
    cfg = yarn_config(dim, base, yarn_rotary_scaling_factor=factor,
                      yarn_original_max_position_embeddings=original, yarn_beta_fast=betas[0],
                      yarn_beta_slow=betas[1], yarn_mscale=mscales[0],
                      yarn_mscale_all_dim=mscales[1],
                      yarn_correction_range_round_to_int=round_to_int)  # fmt: skip
    seq = 50
    cos, sin = rotary(seq, dim, CPU, base, yarn=cfg)
    want_cos, want_sin = megatron_core_cos_sin(cfg, seq)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    inv = yarn_inv_freq(dim, base, factor, original, *betas, round_to_int)
    theirs, attention_factor = transformers_yarn(cfg)
    assert torch.equal(inv, theirs)
    m = yarn_concentration(factor, *mscales)
    assert attention_factor == pytest.approx(m, rel=1e-15, abs=0)
    # rotary() is those frequencies' angles times the factor; read back, the scaling written
    # for transformers gives the same frequencies and (to a unit in the last place) factor.
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    assert torch.equal(cos, angles.cos() * m)
    back, problem = yarn_from_hf(hf_yarn(cfg), {})
    assert problem is None
    read = yarn_config(dim, base, **{k: v for k, v in back.items() if k != "rope_type"})
    assert yarn_concentration(factor, read.yarn_mscale, read.yarn_mscale_all_dim) == (
        pytest.approx(m, rel=1e-14, abs=0)
    )
    assert all(getattr(read, k) == getattr(cfg, k) for k in back if "mscale" not in k)


def test_fast_pairs_are_kept_slow_ones_divided_and_the_range_between_blended():
    """Qwen3-style: heads of 128, base 1e6, an original context of 32768 extended 4 times.
    Pairs turning over 32 times in 32768 positions keep their frequency, those turning less
    than once are divided by 4, the pairs between (the correction range, rounded outwards) lie
    strictly between; the concentration is 0.1 ln 4 + 1."""
    dim, base, factor, original = 128, 1e6, 4.0, 32768
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaled = yarn_inv_freq(dim, base, factor, original)
    turns = original * plain.double() / (2 * math.pi)
    low, high = correction_range(32.0, 1.0, dim, base, original)
    assert (low, high) == (math.floor(low), math.ceil(high)) and 0 < low < high < dim // 2
    pairs = torch.arange(dim // 2)
    kept, divided = pairs <= low, pairs >= high
    assert (turns[kept] > 32).all() and (turns[divided] < 1.1).all()
    assert kept.sum() > 10 and divided.sum() > 10
    assert torch.equal(scaled[kept], plain[kept])
    assert torch.allclose(scaled[divided], plain[divided] / factor, rtol=1e-7, atol=0)
    between = ~kept & ~divided
    assert between.sum() >= 5
    assert (scaled[between] < plain[between]).all()
    assert (scaled[between] > plain[between] / factor).all()
    assert (scaled[1:] < scaled[:-1]).all()  # the blend neither jumps nor folds
    assert yarn_concentration(factor) == pytest.approx(0.1 * math.log(4) + 1, rel=1e-15)
    # Unrounded, the range's ends are the fractional pairs turning 32 times and once.
    low_f, high_f = correction_range(32.0, 1.0, dim, base, original, round_to_int=False)
    pair_turns = [original / (2 * math.pi * base ** (2 * x / dim)) for x in (low_f, high_f)]
    assert pair_turns == pytest.approx([32.0, 1.0], rel=1e-12)
    # Factor 1: rope's own frequencies and no concentration.
    assert torch.equal(yarn_inv_freq(dim, base, 1.0, original), plain)
    assert yarn_concentration(1.0, 0.5, 2.0) == 1.0


def test_the_concentration_multiplies_cos_and_sin_so_the_logits_by_its_square():
    cfg = yarn_config(16, yarn_rotary_scaling_factor=8.0, yarn_mscale=2.0,
                      yarn_mscale_all_dim=0.5)  # fmt: skip
    m = (0.2 * math.log(8) + 1) / (0.05 * math.log(8) + 1)
    cos, sin = rotary(5, 16, CPU, yarn=cfg)
    assert cos[0].tolist() == pytest.approx([m] * 8, rel=1e-6)  # position 0: cos 1 times m
    assert (cos**2 + sin**2).sqrt().flatten().tolist() == pytest.approx([m] * 40, rel=1e-6)


LLAMA = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
             normalization="rmsnorm", position_embedding="rotary", activation="swiglu")  # fmt: skip


def llama(**kw: object) -> GPTConfig:
    return GPTConfig(**{**LLAMA, **kw})


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rope_type="ntk"), "rope_type='ntk'; use one of rope, yarn"),
        (dict(position_embedding="learned", rope_type="yarn"), "needs position_embedding"),
        (dict(rope_type="yarn", rope_scaling=True), "yarn with --use-rope-scaling: "),
        (
            dict(rope_type="yarn", rotary_seq_len_interpolation_factor=2.0),
            "yarn with --rotary-seq-len-interpolation-factor 2.0: .*ignores",
        ),
        (dict(rope_type="yarn", rotary_percent=0.5), "yarn with --rotary-percent 0.5: "),
        (dict(rope_type="yarn", rotary_interleaved=True), "refuses --rotary-interleaved"),
        (
            dict(rope_type="yarn", yarn_rotary_scaling_factor=0.5),
            "--rotary-scaling-factor 0.5 .*at least 1",
        ),
        (
            dict(rope_type="yarn", yarn_original_max_position_embeddings=0),
            "--yarn-original-max-position-embeddings 0: ",
        ),
        (
            dict(rope_type="yarn", yarn_beta_fast=1.0, yarn_beta_slow=32.0),
            "--yarn-beta-fast 1 and --yarn-beta-slow 32: .*0 < beta_slow < beta_fast",
        ),
        (
            dict(rope_type="yarn", yarn_rotary_scaling_factor=4.0, yarn_mscale=-20.0),
            "--mscale -20 and --mscale-all-dim 0 with --rotary-scaling-factor 4: ",
        ),
    ],
)
def test_what_yarn_cannot_take_is_refused_naming_the_flags(kw, match):
    with pytest.raises(ConfigError, match=match):
        llama(**kw)


def test_settings_mean_nothing_without_yarn():
    """GPTConfig keeps YaRN's settings without YaRN (Megatron-LM ignores them then; megart
    train refuses them, tests/test_yarn_flags.py), and its rope is plain rope's."""
    cfg = llama(yarn_rotary_scaling_factor=4.0)
    plain = rotary(16, 8, CPU)
    assert cfg.rope_type == "rope"
    assert torch.equal(rotary(16, 8, CPU, yarn=None)[0], plain[0])
