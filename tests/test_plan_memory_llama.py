"""megart plan's per-layer activation count against what one megart layer saves for backward
(torch's saved-tensor hooks, one process), over the model options that change those saves:
rope (whole or partial), SwiGLU or squared ReLU, RMSNorm, grouped queries (one group, some,
one per head), no biases, hidden dropout, --qk-layernorm, --kv-channels, fp32 or bf16
autocast, selective recomputation of any --recompute-modules (core_attn, layernorm, mlp) or
none.
The real-rank rows (tp2, pp2, sequence parallelism) are in test_plan_memory.py's CASES.

The plan counts a GPU's kernels; a CPU's dropout keeps its mask in the activations' dtype where
a GPU's keeps one byte per element, added here as a CPU term. Attention dropout stays 0: it
sends a CPU to the math kernel (s x s matrices flash attention does not keep). Uncounted, under
bf16: the 16-bit casts of 1-D weights and CPU LayerNorm's 16-bit mean and rstd (O(h) and
O(s b) bytes against O(s b h), under 0.3% here); with --qk-layernorm and LayerNorm the heads'
16-bit mean and rstd are a CPU term, as the masks (2-3% of a layer here)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.models.blocks import Block
from megart.models.config import GPTConfig
from megart.models.recompute import MODULES
from megart.models.rope import rotary
from megart.plan import activations as act
from plan_workers import SavedBytes

SEQ, BATCH = 32, 5  # 160 tokens: no weight's dimension (SavedBytes leaves those out)


def saved_by_one_layer(cfg: GPTConfig, bf16: bool) -> int:
    """Bytes one Block's forward leaves saved for its backward (its input not counted: the
    previous layer's output, a leaf here), once it has run: --recompute-modules layernorm
    frees the norms' outputs only after the products that read them have run."""
    torch.manual_seed(0)
    block = Block(cfg, 0, None, False)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(SEQ, BATCH, cfg.hidden_size, dtype=dtype, requires_grad=True)
    rope = None
    if cfg.position_embedding == "rotary":
        rope = rotary(SEQ, cfg.rotary_dim, x.device, cfg.rotary_base)
    meter = SavedBytes(list(block.parameters()))
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with meter.hooks(), cast:
        y = block(x, rope)
    held = meter.now
    del y
    return held


def planned(cfg: GPTConfig, bf16: bool) -> float:
    """The plan's bytes for one layer and microbatch, with the chunk's rope tables, plus what
    a CPU's dropout masks keep beyond a GPU's one byte."""
    prec = act.precision_of(bf16, False)
    rec = cfg.recompute_granularity
    want = act.layer_bytes(cfg, BATCH, 1, False, rec, prec) + act.rope_table_bytes(cfg)
    if cfg.hidden_dropout > 0:
        want += 2 * SEQ * BATCH * cfg.hidden_size * (prec.other - 1)
    if cfg.qk_layernorm and cfg.normalization == "layernorm" and bf16:
        # A CPU's 16-bit LayerNorm keeps each head's mean and rstd 16-bit, a GPU's fp32.
        heads = cfg.num_attention_heads + cfg.query_groups
        want -= SEQ * BATCH * heads * 2 * (4 - 2)
    return want


def llama(**kw: object) -> GPTConfig:
    base = dict(
        seq_length=SEQ,
        hidden_size=64,
        num_attention_heads=8,
        num_layers=1,
        vocab_size=256,
        normalization="rmsnorm",
        activation="swiglu",
        position_embedding="rotary",
        bias=False,
        num_query_groups=2,
    )
    return GPTConfig(**{**base, **kw})


def recomputing(cfg: GPTConfig, modules: tuple[str, ...] | None) -> GPTConfig:
    """``cfg`` under selective recomputation of ``modules`` (None: no recomputation)."""
    if modules is None:
        return dataclasses.replace(cfg, recompute_granularity=None)
    return dataclasses.replace(cfg, recompute_granularity="selective", recompute_modules=modules)


# None, Megatron's default, the norms with the MLP, and all three.
MODULE_SETS = [None, ("core_attn",), ("layernorm", "mlp"), MODULES]


@pytest.mark.parametrize("recompute", MODULE_SETS, ids=str)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "name,cfg",
    [
        ("llama", llama()),
        ("llama mha", llama(num_query_groups=None)),
        ("llama mqa", llama(num_query_groups=1)),
        ("llama partial rope", llama(rotary_percent=0.5)),
        ("qwen3 (--qk-layernorm)", llama(qk_layernorm=True)),
        # --kv-channels: heads 16 wide on h 64 / 8 heads (q = 128, as Qwen3's head_dim 128),
        # and 4 wide with learned positions and one group per head (q = 32).
        ("qwen3 --kv-channels 16", llama(qk_layernorm=True, kv_channels=16)),
        (
            "mha --kv-channels 4, learned",
            llama(kv_channels=4, num_query_groups=None, position_embedding="learned"),
        ),
        (
            "qk-layernorm, learned, layernorm",
            llama(qk_layernorm=True, normalization="layernorm", position_embedding="learned"),
        ),
        (
            "gpt-2 with rope",
            GPTConfig(
                seq_length=SEQ,
                hidden_size=64,
                num_attention_heads=4,
                num_layers=1,
                position_embedding="rotary",
            ),
        ),
    ],  # fmt: skip
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_one_layer_saves_what_the_plan_counts(name, cfg, bf16, recompute):
    cfg = recomputing(cfg, recompute)
    got, want = saved_by_one_layer(cfg, bf16), planned(cfg, bf16)
    # fp32: every saved tensor is counted, to the byte; bf16: see the module's docstring.
    assert got == pytest.approx(want, rel=0.01 if bf16 else 0), (name, got, want, got / want)


@settings(max_examples=40, deadline=None)
@given(
    rope=st.booleans(),
    partial=st.booleans(),
    activation=st.sampled_from(["gelu", "swiglu", "squared_relu"]),
    rmsnorm=st.booleans(),
    groups=st.sampled_from([None, 1, 2, 4]),
    bias=st.booleans(),
    dropout=st.sampled_from([0.0, 0.1]),
    bf16=st.booleans(),
    recompute=st.one_of(st.none(), st.lists(st.sampled_from(MODULES), max_size=3).map(tuple)),
    qk=st.booleans(),
    # --kv-channels: q = 32 or 96 on h 64 (not 16: with one group the fused q/k/v weight
    # would be 160 x 64, the shape of the 160 tokens' norm output, which SavedBytes skips)
    head=st.sampled_from([None, 4, 12]),
)
def test_any_option_mix(
    rope, partial, activation, rmsnorm, groups, bias, dropout, bf16, recompute, qk, head
):
    cfg = llama(
        kv_channels=head,
        qk_layernorm=qk,
        position_embedding="rotary" if rope else "learned",
        rotary_percent=0.5 if partial and rope else 1.0,
        activation=activation,
        normalization="rmsnorm" if rmsnorm else "layernorm",
        num_query_groups=groups,
        bias=bias,
        hidden_dropout=dropout,
    )
    cfg = recomputing(cfg, recompute)
    got, want = saved_by_one_layer(cfg, bf16), planned(cfg, bf16)
    assert got == pytest.approx(want, rel=0.01 if bf16 else 0), (cfg, bf16, got, want)


def test_rope_keeps_more_than_learned_positions():
    """rope's q and k are new tensors, and the attention output a copy of its own: 3 h more
    per token than learned positions with multi-head attention (plus the cos/sin tables)."""
    h = 64
    rope = llama(num_query_groups=None, activation="gelu", normalization="layernorm")
    learned = llama(
        num_query_groups=None, activation="gelu", normalization="layernorm",
        position_embedding="learned",
    )  # fmt: skip
    prec = act.precision_of(False, False)
    diff = act.layer_bytes(rope, 1, 1, False, None, prec) - act.layer_bytes(
        learned, 1, 1, False, None, prec
    )
    assert diff == SEQ * 3 * h * 4


def test_megart_plan_takes_the_options_the_count_depends_on(capsys):
    """--hidden-dropout, --rotary-percent and --qk-layernorm reach the count from the command
    line: the masks' 2 h / t bytes per token and layer under sequence parallelism (b = 1, t = 2,
    32 layers) and the embedding's h / t, rope's smaller tables, the query and key norms'."""
    from plan_workers import plan_json

    base = ("--gpu h100-80gb --num-gpus 8 --num-layers 32 --hidden-size 4096 "
            "--num-attention-heads 32 --seq-length 4096 --vocab-size 32000 --global-batch-size 64 "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --micro-batch-size 1 "
            "--position-embedding-type rope --sequence-parallel --hidden-dropout 0")  # fmt: skip
    extras = ("", " --hidden-dropout 0.1", " --rotary-percent 0.5", " --qk-layernorm")
    gib = {extra: plan_json(base + extra, capsys)["memory_gib"]["activations"]
           for extra in extras}  # fmt: skip
    held = 1  # 1F1B on one stage: the microbatch in flight
    masks = (2 * 32 + 1) * 4096 * 4096 / 2 * held / 2**30  # one byte per element
    assert gib[" --hidden-dropout 0.1"] - gib[""] == pytest.approx(masks)
    assert 0 < gib[""] - gib[" --rotary-percent 0.5"] < 1e-2
    # LayerNorm's fp32 mean and rstd per query and key head (32 + 32 heads over t = 2), and
    # q and k become the norms' outputs: rope's, already new tensors here, so nothing else.
    stats = 32 * 4096 * (32 + 32) / 2 * 2 * 4 / 2**30
    assert gib[" --qk-layernorm"] - gib[""] == pytest.approx(stats)
