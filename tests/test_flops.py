"""The FLOPs megart counts (megart.training.flops) for any MLP size and SwiGLU: the SC21 paper's
formula exactly at 4h with GeLU, the sum of the matrix products otherwise, and torch's own FLOP
counter's on real models."""

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.models import GPT, GPTConfig
from megart.training.flops import iteration_flops, model_flops

sizes = st.integers(1, 1 << 14)


@settings(max_examples=200, deadline=None)
@given(b=sizes, s=sizes, l=st.integers(1, 256), h=sizes, v=st.integers(1, 1 << 18))
def test_flops_reduce_exactly_to_the_papers_formula_at_4h_gelu(b, s, l, h, v):
    paper = Fraction(72 * b * s * l * h * h) * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * l * h))
    full = Fraction(96 * b * s * l * h * h) * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h))
    # The paper counts the whole s x s attention matrix; Megatron (and megart by default) the
    # causal half: 2 B s^2 h less per layer in each of the three passes (four recomputing).
    assert iteration_flops(b, s, l, h, v, causal=False) == paper
    assert iteration_flops(b, s, l, h, v, ffn_hidden=4 * h, swiglu=False, causal=False) == paper
    assert iteration_flops(b, s, l, h, v, recompute=True, causal=False) == full
    assert iteration_flops(b, s, l, h, v) == paper - 6 * b * s * s * h * l
    assert iteration_flops(b, s, l, h, v, recompute=True) == full - 8 * b * s * s * h * l


def matmul_count(b, s, l, h, v, f, heads, swiglu, recompute):
    """2 m k n per (m x k) @ (k x n) product of one forward, summed over a layer's products
    and the logits; backward computes two products of each (input and weight gradients)."""
    d = h // heads
    layer = [(b * s, h, 3 * h), (b * s, h, h), (b * s, f, h)]
    layer += [(b * s, h, f)] * (2 if swiglu else 1)
    layer += [(s, d, s), (s, s, d)] * (b * heads)  # scores and values, per sequence and head
    forward = sum(2 * m * k * n for m, k, n in layer)
    logits = 2 * (b * s) * h * v
    return (3 + recompute) * l * forward + 3 * logits


@settings(max_examples=200, deadline=None)
@given(
    b=st.integers(1, 64),
    s=st.integers(1, 4096),
    l=st.integers(1, 96),
    heads=st.integers(1, 64),
    d=st.integers(1, 256),
    f=st.integers(1, 1 << 15),
    v=st.integers(1, 1 << 17),
    swiglu=st.booleans(),
    recompute=st.booleans(),
)
def test_flops_of_any_mlp_size_and_swiglu_sum_the_matmuls(
    b, s, l, heads, d, f, v, swiglu, recompute
):
    h = heads * d
    got = iteration_flops(b, s, l, h, v, recompute, ffn_hidden=f, swiglu=swiglu, causal=False)
    assert got == matmul_count(b, s, l, h, v, f, heads, swiglu, recompute)


def torch_count(layers: int, **kw: object) -> tuple[GPTConfig, int]:
    """A small GPT of ``layers`` layers and the FLOPs torch's counter sees in its forward and
    backward over 3 sequences of 16 tokens: the math attention kernel (products torch can
    count), and checkpoints that replay the whole forward (early stop off)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode

    cfg = GPTConfig(
        vocab_size=256, seq_length=16, hidden_size=32, num_layers=layers, num_attention_heads=4,
        **kw,
    )  # fmt: skip
    model = GPT(cfg)
    tokens = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    with (
        set_checkpoint_early_stop(False),
        sdpa_kernel(SDPBackend.MATH),
        FlopCounterMode(display=False) as counter,
    ):
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return cfg, counter.get_total_flops()


@pytest.mark.parametrize(
    "kw",
    [
        dict(activation="swiglu", ffn_hidden_size=48),
        dict(ffn_hidden_size=24),
        dict(activation="swiglu", recompute_granularity="full"),
        {},
        # Llama-style: rope (elementwise, no products), grouped queries (narrower k and v
        # projections; the core over every query head, keys repeated), SwiGLU.
        dict(
            activation="swiglu",
            num_query_groups=2,
            position_embedding="rotary",
            normalization="rmsnorm",
            bias=False,
        ),
        # --kv-channels: heads of 16 on h = 32 (q = 64 wide), and of 4 (q = 16).
        dict(activation="swiglu", num_query_groups=2, kv_channels=16, bias=False),
        dict(kv_channels=4),
        # --recompute-modules: the MLPs' forward again (layernorm runs no product); with
        # core_attn the core's two products too.
        dict(activation="swiglu", recompute_granularity="selective", recompute_modules=("mlp",)),
        dict(
            recompute_granularity="selective", recompute_modules=("core_attn", "layernorm", "mlp")
        ),
    ],
    ids=[
        "swiglu-48",
        "gelu-24",
        "swiglu-4h-recompute",
        "gpt2",
        "llama-gqa-rope",
        "wide-heads",
        "narrow-heads",
        "swiglu-mlp-recomputed",
        "all-modules-recomputed",
    ],  # fmt: skip
)
def test_flops_equal_torchs_flop_counter_on_the_model(kw):
    """torch counts the products a real forward and backward run (the attention core through
    the math kernel, which is made of products torch can count). The paper counts a whole
    recomputed forward; torch's checkpoint stops recomputing once backward's saved tensors are
    back, skipping each recomputed group's last product, unless early stop is off."""
    cfg, counted = torch_count(layers=2, **kw)
    recompute = cfg.recompute_granularity == "full"
    selective = dict(selective=cfg.recomputes("core_attn"), mlp_again=cfg.recomputes("mlp"))
    # torch's math kernel multiplies the whole s x s matrix (the mask applied after).
    got = model_flops(cfg, 3, recompute, causal=False, **selective)
    assert got == counted


@settings(max_examples=200, deadline=None)
@given(
    b=st.integers(1, 64),
    s=st.integers(1, 8192),
    l=st.integers(1, 96),
    groups=st.integers(1, 16),
    per_group=st.integers(1, 8),
    d=st.integers(1, 256),
    f=st.integers(1, 1 << 15),
    v=st.integers(1, 1 << 17),
    swiglu=st.booleans(),
    hidden=st.none() | st.integers(1, 1 << 14),
)
def test_flops_of_grouped_queries_and_swiglu_are_megatrons(
    b, s, l, groups, per_group, d, f, v, swiglu, hidden
):
    """Megatron-LM's num_floating_point_operations for a dense GPT (facts from its
    training.py): per token and layer, 3 passes x 2 FLOPs per multiply-add over the q/k/v
    projection h (q + 2 kv) and the output projection q h, q = heads x head size and kv =
    groups x head size; the MLP h f times 3 with SwiGLU, 2 without; the logits h V once; per
    sequence and layer, the same 6 times q s^2 / 2 (the causal half) for each of the scores
    and the scores x values. ``hidden``: an h other than q (--kv-channels)."""
    heads = groups * per_group
    q = heads * d
    h = q if hidden is None else hidden
    kv = groups * d
    token = 6 * l * (h * (q + 2 * kv) + q * h + h * f * (3 if swiglu else 2)) + 6 * h * v
    core = 6 * l * q * s * s  # 2 products x q s^2 / 2 each, x 3 passes x 2 FLOPs
    megatron = b * s * token + b * core
    kw = dict(ffn_hidden=f, swiglu=swiglu, kv_hidden=kv)
    assert iteration_flops(b, s, l, h, v, **kw, query_hidden=q) == megatron
    if hidden is None:  # q = h: the default
        assert iteration_flops(b, s, l, h, v, **kw) == megatron


@settings(max_examples=200, deadline=None)
@given(b=sizes, s=sizes, l=st.integers(1, 256), h=sizes, v=st.integers(1, 1 << 18))
def test_selective_recomputation_runs_every_attention_core_once_more(b, s, l, h, v):
    """Selective recomputation's replay: both of the core's products (2 B s^2 h each over the
    whole s x s matrix, half causal) in every layer; nothing else. Korthikanti et al.'s hardware
    count, s/(3h) in place of the model's s/(6h), is three times that replay."""
    for causal, per_product in ((False, 2 * b * s * s * h), (True, b * s * s * h)):
        model = iteration_flops(b, s, l, h, v, causal=causal)
        selective = iteration_flops(b, s, l, h, v, causal=causal, selective=True)
        assert selective - model == l * 2 * per_product
    korthikanti = Fraction(72 * b * s * l * h * h) * (
        1 + Fraction(s, 3 * h) + Fraction(v, 12 * l * h)
    )
    replay = iteration_flops(b, s, l, h, v, causal=False, selective=True)
    replay -= iteration_flops(b, s, l, h, v, causal=False)
    assert korthikanti - iteration_flops(b, s, l, h, v, causal=False) == 3 * replay
    with pytest.raises(ValueError, match="exclusive"):
        iteration_flops(b, s, l, h, v, recompute=True, selective=True)


def megatron_moe_flops(b, s, l, h, v, f, swiglu, pattern, moe_ffn, topk):
    """Megatron-LM's num_floating_point_operations for a GPT with --num-experts (facts from its
    training.py, written out here): per token, 3 passes x 2 FLOPs x h times the dense layers'
    f x (3 with SwiGLU, else 2) plus the MoE layers' moe_ffn x topk x the same factor (no
    router, no shared experts); attention and logits as for a dense model (multi-head here)."""
    factor = 3 if swiglu else 2
    moe_layers = sum(pattern)
    mlp = 6 * h * (f * factor * (l - moe_layers) + moe_ffn * topk * factor * moe_layers)
    attention = 6 * l * (h * 3 * h + h * h)
    return b * s * (mlp + attention + 6 * h * v) + b * s * s * 6 * l * h


@settings(max_examples=200, deadline=None)
@given(
    b=st.integers(1, 64),
    s=st.integers(1, 4096),
    pattern=st.lists(st.integers(0, 1), min_size=1, max_size=48),
    h=st.integers(1, 1 << 13),
    f=st.integers(1, 1 << 15),
    moe_ffn=st.integers(1, 1 << 15),
    topk=st.integers(1, 8),
    v=st.integers(1, 1 << 17),
    swiglu=st.booleans(),
)
def test_moe_flops_are_megatrons(b, s, pattern, h, f, moe_ffn, topk, v, swiglu):
    """Any mix of dense and MoE layers: Megatron-LM's count, the routed experts' products
    moe_ffn x topk wide, whichever layers are MoE (only how many)."""
    l = len(pattern)
    got = iteration_flops(b, s, l, h, v, ffn_hidden=f, swiglu=swiglu, moe_layers=sum(pattern),
                          routed_hidden=moe_ffn * topk)  # fmt: skip
    assert got == megatron_moe_flops(b, s, l, h, v, f, swiglu, pattern, moe_ffn, topk)
    dense = iteration_flops(b, s, l, h, v, ffn_hidden=f, swiglu=swiglu)
    assert (got == dense) == (sum(pattern) == 0 or moe_ffn * topk == f)


def test_moe_replays_must_say_which_layers():
    """Full recomputation of some layers of a mixed model: which are MoE layers changes the
    count, so it must be given; all or none replayed needs no telling."""
    kw = dict(ffn_hidden=64, moe_layers=2, routed_hidden=96)
    with pytest.raises(ValueError, match="replayed_moe"):
        iteration_flops(2, 8, 4, 16, 32, recompute=True, replayed=2, **kw)
    one = iteration_flops(2, 8, 4, 16, 32, recompute=True, replayed=2, replayed_moe=1, **kw)
    two = iteration_flops(2, 8, 4, 16, 32, recompute=True, replayed=2, replayed_moe=2, **kw)
    assert two - one == 2 * 2 * 2 * 8 * 16 * (96 - 64)  # one MLP's forward, MoE for dense
    with pytest.raises(ValueError, match="replayed_moe=3"):
        iteration_flops(2, 8, 4, 16, 32, recompute=True, replayed=2, replayed_moe=3, **kw)


MOE = dict(num_experts=4, bias=False, moe_ffn_hidden_size=24)


@pytest.mark.parametrize(
    "kw",
    [
        dict(MOE),
        dict(MOE, activation="swiglu", moe_router_topk=1, moe_router_pre_softmax=True),
        dict(MOE, moe_layer_freq=(0, 1, 1), moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
        dict(MOE, moe_layer_freq=2, activation="swiglu", recompute_granularity="full"),
        dict(MOE, moe_layer_freq=(1, 0, 1), recompute_granularity="full",
             recompute_method="block", recompute_num_layers=2),
        dict(MOE, moe_layer_freq=(1, 0, 0), recompute_granularity="selective",
             recompute_modules=("core_attn", "mlp")),
    ],
    ids=["every-layer", "swiglu-top1", "pattern-losses", "freq2-full", "block2", "mlp-dense-only"],
)  # fmt: skip
def test_moe_flops_are_torchs_count_less_the_router(kw):
    """torch's FLOP counter over a real MoE GPT's forward and backward: the experts run on
    the tokens routed to them, k of them per token, so their products are exactly those of
    one MLP moe_ffn x k wide whatever the routing; the router's h x E product (forward, and
    its two backward products) is the one thing Megatron's count, and megart's, leave out.
    Replays: full recomputation replays the router too; --recompute-modules mlp only dense
    layers' MLPs."""
    from megart.models.recompute import recomputed_spans

    cfg, counted = torch_count(layers=3, **kw)
    full = cfg.recompute_granularity == "full"
    spans = recomputed_spans(3, cfg.recompute_method, cfg.recompute_num_layers) if full else []
    again = [i for start, stop, rec in spans if rec for i in range(start, stop)]
    moe = [i for i in range(3) if cfg.is_moe_layer(i)]
    router = 2 * 3 * 16 * 32 * 4  # tokens x h x E, x 2 FLOPs
    passes = 3 * len(moe) + len([i for i in again if i in moe])
    got = model_flops(
        cfg, 3, full, causal=False, replayed=len(again),
        replayed_moe=len([i for i in again if i in moe]), mlp_again=cfg.recomputes("mlp"),
        selective=cfg.recomputes("core_attn"),
    )  # fmt: skip
    assert got + passes * router == counted
