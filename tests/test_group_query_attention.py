"""Grouped-query attention (--group-query-attention --num-query-groups N): one process matches
a plain-torch reference written head by head; one group per head is the multi-head model bit
for bit; a GQA model follows the single-process loss curve under tp2, tp2 with sequence
parallelism and pp2, and a tp2 checkpoint resumes resharded under tp1; bad flag combinations
are refused naming the flags; --load of another GQA setting and export-hf refuse it; the FLOPs
count the smaller key/value projections, as torch's own counter does."""

import argparse
import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import LaunchError, launch
from megart.models import GPT, GPTConfig
from megart.models.attention import Attention
from megart.models.config import architecture_flags
from megart.models.hf_gpt2 import check as check_gpt2
from megart.models.rope import rotary
from megart.training.data import builtin_corpus
from megart.training.export_hf import export_checkpoint
from megart.training.flops import iteration_flops, model_flops

# 8 heads of size 4 in 4 groups: under tp2 each rank holds two groups of two query heads, so a
# rank's slice must keep whole groups in order. Rotary positions rotate the shared keys.
GQA = dict(
    num_attention_heads=8,
    group_query_attention=True,
    num_query_groups=4,
    position_embedding_type="rope",
)
# The learning rate decays over 5 iterations in every run, so a 2-iteration run that saves and
# a resumed one follow the same schedule as the 4-iteration reference.
BASE = dict(train_iters=4, lr_decay_iters=5, **GQA)


def parse(*argv: str):
    """The TrainConfig that `megart train ARGV` runs."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


# -- the attention against a reference written head by head -------------------------------


def reference_attention(x, attn, heads, groups, rope):
    """Causal attention of x [s, b, h] in float64 from ``attn``'s weights, read as documented:
    the fused projection's rows per group g are [q of heads g*n..g*n+n-1, k_g, v_g] (n =
    heads/groups), and head i attends with its group's key and value."""
    s, b, h = x.shape
    d, n = h // heads, heads // groups
    y = x @ attn.qkv.weight.t()
    if attn.qkv.bias is not None:
        y = y + attn.qkv.bias

    def rows(start):
        return y[..., start * d : (start + 1) * d]  # [s, b, d]

    def rotate(t):
        # RoFormer's rotation of pair i by position p times 10000^(-2i/d); the pairs are
        # (2i, 2i+1) interleaved, else (i, i + d/2) (Megatron's default).
        p = torch.arange(s, dtype=torch.float64)[:, None, None]
        i = torch.arange(d // 2, dtype=torch.float64)
        angle = p * 10000.0 ** (-2 * i / d)
        pairs = [i.long() * 2, i.long() * 2 + 1]
        if not attn.cfg.rotary_interleaved:
            pairs = [i.long(), i.long() + d // 2]
        first, second = t[..., pairs[0]], t[..., pairs[1]]
        out = torch.empty_like(t)
        out[..., pairs[0]] = first * angle.cos() - second * angle.sin()
        out[..., pairs[1]] = first * angle.sin() + second * angle.cos()
        return out

    causal = torch.ones(s, s, dtype=torch.bool).tril()
    outputs = []
    for i in range(heads):
        g, j = divmod(i, n)
        q, k, v = rows(g * (n + 2) + j), rows(g * (n + 2) + n), rows(g * (n + 2) + n + 1)
        if rope:
            q, k = rotate(q), rotate(k)
        per_sample = []
        for bb in range(b):
            scores = q[:, bb] @ k[:, bb].t() / math.sqrt(d)
            weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            per_sample.append(weights @ v[:, bb])
        outputs.append(torch.stack(per_sample, dim=1))  # [s, b, d]
    out = torch.cat(outputs, dim=-1) @ attn.proj.weight.t()
    return out if attn.proj.bias is None else out + attn.proj.bias


@st.composite
def attention_shapes(draw):
    heads = draw(st.integers(1, 4))
    groups = draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))
    return dict(
        heads=heads,
        groups=groups,
        d=draw(st.sampled_from([2, 4])),
        s=draw(st.integers(1, 6)),
        b=draw(st.integers(1, 3)),
        bias=draw(st.booleans()),
        rope=draw(st.booleans()),
        interleaved=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None)
@given(shape=attention_shapes())
def test_attention_equals_the_head_by_head_reference(shape):
    heads, groups, d, s, b = (shape[k] for k in ("heads", "groups", "d", "s", "b"))
    h = heads * d
    cfg = GPTConfig(vocab_size=8, seq_length=s, hidden_size=h, num_layers=1,
                    num_attention_heads=heads, num_query_groups=groups,
                    bias=shape["bias"], rotary_interleaved=shape["interleaved"])  # fmt: skip
    attn = Attention(cfg, 0, None, False).double()
    assert attn.qkv.weight.shape == ((heads + 2 * groups) * d, h)
    g = torch.Generator().manual_seed(shape["seed"])
    with torch.no_grad():
        for p in attn.parameters():  # away from init's small values and zero biases
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / 2)
    x = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    rope = rotary(s, d, x.device) if shape["rope"] else None
    out = attn(x, rope)
    cotangent = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, list(attn.parameters()), cotangent)
    ref = reference_attention(x, attn, heads, groups, shape["rope"])
    want = torch.autograd.grad(ref, list(attn.parameters()), cotangent)
    # megart's rotary runs in float32 (its angles and the rotation), as Megatron's does.
    tol = dict(rtol=1e-5, atol=1e-5) if shape["rope"] else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref, **tol)
    for a, w in zip(got, want, strict=True):  # k/v gradients summed over each group's heads
        torch.testing.assert_close(a, w, **tol)


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_one_group_per_head_is_the_multi_head_model_bit_for_bit(position):
    def model(**kw):
        cfg = GPTConfig(vocab_size=256, seq_length=16, hidden_size=32, num_layers=2,
                        num_attention_heads=4, position_embedding=position, **kw)  # fmt: skip
        return GPT(cfg)

    mha, grouped = model(), model(num_query_groups=4)
    assert mha.state_dict().keys() == grouped.state_dict().keys()
    for name, w in mha.state_dict().items():
        assert torch.equal(w, grouped.state_dict()[name]), name
    tokens = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    losses = [m(tokens[:, :-1], tokens[:, 1:]) for m in (mha, grouped)]
    assert torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(mha.named_parameters(), grouped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    # The same architecture: --load and export-hf treat it as multi-head attention.
    assert architecture_flags(grouped.cfg) == architecture_flags(mha.cfg)
    if position == "learned":
        check_gpt2(grouped.cfg)  # refuses nothing
    assert model_flops(grouped.cfg, 8) == model_flops(mha.cfg, 8)


# -- under every parallelism ---------------------------------------------------------------


def _train(kw):
    """Trains a tiny GPT; returns the figures, the first layer's qkv shard shape and the FLOPs
    the trainer counts."""
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    shape = tuple(trainer.chunks[0].blocks[0].attn.qkv.weight.shape)
    return trainer.train(quiet=True), shape, trainer.flops


@pytest.fixture(scope="module")
def reference():
    return launch(_train, 1, BASE, timeout=300)[0]


def test_the_reference_is_grouped_query_attention(reference):
    history, shape, flops = reference
    # 8 query heads and 4 key/value heads of size 4: (8 + 2 x 4) x 4 rows of hidden size 32.
    assert shape == (64, 32)
    assert flops == iteration_flops(8, 16, 4, 32, 256, kv_hidden=16)
    assert flops < iteration_flops(8, 16, 4, 32, 256)
    assert history[-1]["loss"] < history[0]["loss"]


@pytest.mark.parametrize(
    "layout",
    [
        dict(tensor_model_parallel_size=2),
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        dict(pipeline_model_parallel_size=2),
    ],
    ids=["tp2", "tp2-sequence-parallel", "pp2"],
)
def test_every_layout_follows_the_single_process_loss_curve(layout, reference):
    ref = reference[0]
    for history, shape, _ in launch(_train, 2, {**BASE, **layout}, timeout=300):
        assert shape == (64 // layout.get("tensor_model_parallel_size", 1), 32)
        assert len(history) == len(ref) == 4
        for h, r in zip(history, ref, strict=True):
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
            assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)


def test_a_tp2_checkpoint_resumes_resharded_under_tp1_and_is_refused_otherwise(reference, tmp_path):
    launch(_train, 2, {**BASE, "train_iters": 2, "save": str(tmp_path),
                       "tensor_model_parallel_size": 2}, timeout=300)  # fmt: skip
    resumed = launch(_train, 1, dict(BASE, load=str(tmp_path)), timeout=300)[0][0]
    assert [h["iteration"] for h in resumed] == [3, 4]
    # Within 5e-6 of the uninterrupted curve, as test_checkpoint_reshard's resumes (a
    # misplaced shard moves the loss by far more).
    assert [h["loss"] for h in resumed] == pytest.approx(
        [h["loss"] for h in reference[0][2:]], rel=5e-6, abs=0
    )
    # Another group count, or none, is another model.
    message = (
        r"saved with --group-query-attention --num-query-groups 4 \(now --group-query-attention "
        r"--num-query-groups 2\);"
    )
    with pytest.raises(LaunchError, match=message):
        launch(_train, 1, dict(BASE, num_query_groups=2, load=str(tmp_path)), timeout=300)
    # export-hf names the flag: GPT-2 has one key/value head per query head.
    with pytest.raises(ConfigError) as refused:
        export_checkpoint(tmp_path, tmp_path / "hf")
    assert "--group-query-attention --num-query-groups 4 (num_query_groups=4; GPT-2 has 8)" in (
        str(refused.value)
    )


# -- flags -----------------------------------------------------------------------------------


def test_the_flags_reach_gpt_config_and_the_cli_help():
    default = dataclasses.asdict(parse().gpt_config())
    got = dataclasses.asdict(
        parse("--group-query-attention", "--num-query-groups", "2").gpt_config()
    )
    assert got["num_query_groups"] == 2 and default["num_query_groups"] is None
    assert {k: v for k, v in got.items() if k != "num_query_groups"} == {
        k: v for k, v in default.items() if k != "num_query_groups"
    }
    out = subprocess.run([sys.executable, "-m", "megart", "train", "--help"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    text = " ".join(out.stdout.split())
    assert "--group-query-attention grouped-query attention" in text
    assert "--num-query-groups NUM_QUERY_GROUPS key/value heads" in text


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (
            ["--num-query-groups", "2"],
            1,
            "--num-query-groups 2 is used only with --group-query-attention .*; add that flag",
        ),
        (["--group-query-attention"], 1, "--group-query-attention needs --num-query-groups N"),
        (
            ["--group-query-attention", "--num-query-groups", "3"],
            1,
            "--num-query-groups 3 must divide --num-attention-heads 4 .*use one of 1, 2, 4$",
        ),
        (
            ["--group-query-attention", "--num-query-groups", "0"],
            1,
            "--num-query-groups 0 must divide",
        ),
        (
            [
                "--group-query-attention",
                "--num-query-groups",
                "2",
                "--tensor-model-parallel-size",
                "4",
            ],  # fmt: skip
            4,
            "--num-query-groups 2 must divide --num-attention-heads 4 and be divisible by "
            "--tensor-model-parallel-size 4 \\(each rank holds whole groups, as Megatron-LM "
            "requires\\); use one of 4$",
        ),
    ],
)
def test_bad_combinations_are_refused_naming_the_flags(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).check(world)


def test_gpt_config_refuses_groups_that_do_not_fit():
    with pytest.raises(ConfigError, match=r"num_query_groups=3: the 4 attention heads .*\[1, 2, 4"):
        GPTConfig(hidden_size=32, num_attention_heads=4, num_query_groups=3)
    cfg = GPTConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2)
    cfg.check_layout(tp=2)
    with pytest.raises(
        ConfigError,
        match=r"^2 query groups \(--num-query-groups\) of 4 attention heads do not split over "
        r"tensor-parallel size 4 \(use tensor-parallel size 1 or 2\)$",
    ):
        cfg.check_layout(tp=4)
    # Multi-head attention keeps its message.
    with pytest.raises(ConfigError, match=r"^4 attention heads do not split over .* size 3"):
        GPTConfig(hidden_size=32, num_attention_heads=4).check_layout(tp=3)


def test_the_live_gpt2_export_refuses_grouped_query_attention(tmp_path):
    cfg = GPTConfig(vocab_size=64, seq_length=8, hidden_size=16, num_layers=1,
                    num_attention_heads=2, num_query_groups=1)  # fmt: skip
    with pytest.raises(ConfigError, match=r"--group-query-attention --num-query-groups 1 \("):
        GPT(cfg).save_hf_gpt2(str(tmp_path / "hf"))


# -- FLOPs -----------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    b=st.integers(1, 64),
    s=st.integers(1, 4096),
    l=st.integers(1, 96),
    h=st.integers(1, 1 << 14),
    v=st.integers(1, 1 << 17),
    swiglu=st.booleans(),
)
def test_flops_with_one_group_per_head_are_the_multi_head_count(b, s, l, h, v, swiglu):
    assert iteration_flops(b, s, l, h, v, swiglu=swiglu, kv_hidden=h) == iteration_flops(
        b, s, l, h, v, swiglu=swiglu
    )
    # The K and V projections shrink from h to kv wide: 2 b s h (h - kv) each, three passes.
    kv = max(1, h // 4)
    smaller = 3 * l * 2 * (2 * b * s * h * (h - kv))
    assert iteration_flops(b, s, l, h, v, swiglu=swiglu, kv_hidden=kv) == (
        iteration_flops(b, s, l, h, v, swiglu=swiglu) - smaller
    )


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_flops_equal_torchs_flop_counter_on_a_gqa_model(groups):
    """torch counts the products a forward and backward run (the attention core through the
    math kernel, whose products torch can count), as test_trainer_flags does for MHA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = GPTConfig(vocab_size=256, seq_length=16, hidden_size=32, num_layers=2,
                    num_attention_heads=4, num_query_groups=groups)  # fmt: skip
    model = GPT(cfg)
    tokens = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert model_flops(cfg, 3, causal=False) == counter.get_total_flops()  # the whole s x s
