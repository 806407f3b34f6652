"""Sliding-window attention (--window-size LEFT,0, --window-attn-skip-freq): the mask is
Megatron-Core's and Hugging Face's (whose sliding_window W is LEFT = W - 1); one layer's
attention equals a float64 reference written from the definition (GQA, documents); a window
reaching the sequence's start is no window, bit for bit; Megatron-Core's GPTModel (local spec)
computes megart's logits with the window and its layer patterns; context parallelism at cp2 and
cp4 is the one-process model (global positions); tp2 with sequence parallelism, pp2 and cp2
follow the one-process loss curve; bad values are refused naming the flag."""

import argparse
import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_workers as cw
import megatron_core_workers as mcw
import train_workers as tw
from megart import ConfigError
from megart.cli.train import add_arguments, config_from_args
from megart.launcher import launch
from megart.models import GPT, GPTConfig
from megart.models.attention import Attention
from megart.models.documents import document_attention_mask
from megart.models.window_masks import window_mask
from megart.training.megatron_args import config_from_args as megatron_config_from_args
from megart.training.megatron_args import megatron_args

# -- the mask ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [1, 5, 12])
def test_the_mask_is_megatron_cores_and_hugging_faces(seq):
    from megatron.core.transformer.utils import get_sliding_window_causal_mask
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    positions = torch.arange(seq)
    make = mcw.on_cpu(get_sliding_window_causal_mask)
    for left in range(seq + 2):
        ours = window_mask(positions, positions, left)
        assert torch.equal(ours, ~make(seq, seq, (left, 0)))  # Megatron's True: masked
        overlay = sliding_window_overlay(left + 1)  # Hugging Face's W counts the keys
        hf = torch.tensor(
            [[causal_mask_function(0, 0, q, k) and overlay(0, 0, q, k) for k in range(seq)]
             for q in range(seq)]
        )  # fmt: skip
        assert torch.equal(ours, hf), left
        assert ours.sum(1).max() == min(left + 1, seq)  # the token itself and LEFT before it


# -- one layer against the definition --------------------------------------------------------


def reference(x, attn, heads, groups, left, documents=None):
    """Attention of x [s, b, h] in float64 from ``attn``'s weights, each query position i
    summing over the key positions max(0, i - left)..i (of its own document), head i with its
    group's key and value (rows per group: [q of its heads, k, v])."""
    s, b, h = x.shape
    d, n = h // heads, heads // groups
    y = x @ attn.qkv.weight.t() + attn.qkv.bias
    heads_out = []
    for head in range(heads):
        g, j = divmod(head, n)
        q, k, v = (y[..., r * d : (r + 1) * d] for r in (g * (n + 2) + j, g * (n + 2) + n,
                                                           g * (n + 2) + n + 1))  # fmt: skip
        rows = []
        for i in range(s):
            seen = [p for p in range(s) if i - (s if left is None else left) <= p <= i]
            if documents is not None:
                seen = [p for p in seen if documents[:, p].eq(documents[:, i]).all()]
            keys = torch.tensor(seen)
            scores = torch.einsum("bd,kbd->bk", q[i], k[keys]) / math.sqrt(d)
            rows.append(torch.einsum("bk,kbd->bd", scores.softmax(-1), v[keys]))
        heads_out.append(torch.stack(rows))  # [s, b, d]
    return torch.cat(heads_out, -1) @ attn.proj.weight.t() + attn.proj.bias


@settings(max_examples=40, deadline=None)
@given(
    heads_groups=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 1)]),
    s=st.integers(1, 12),
    left=st.integers(-1, 14),
    documents=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_layer_equals_the_definition_in_float64(heads_groups, s, left, documents, seed):
    heads, groups = heads_groups
    h, b = 4 * heads, 2
    cfg = GPTConfig(vocab_size=8, seq_length=s, hidden_size=h, num_layers=1,
                    num_attention_heads=heads, num_query_groups=groups,
                    window_size=(left, 0))  # fmt: skip
    attn = Attention(cfg, 0, None, False).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attn.parameters():  # wide weights: peaked attention shows a wrong key
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    x = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    # Same documents across the batch, so the reference reads one id per position.
    ids = torch.randint(0, 3, (s,), generator=g).sort().values.expand(b, s) if documents else None
    mask = None if ids is None else document_attention_mask(ids)
    want = reference(x, attn, heads, groups, None if left < 0 else left, ids)
    torch.testing.assert_close(attn(x, None, mask), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_a_window_that_reaches_the_start_is_no_window_bit_for_bit(position):
    kw = dict(vocab_size=64, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
              position_embedding=position, init_std=0.5)  # fmt: skip
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = GPT(GPTConfig(**kw))(tokens)
    for left in (15, 16, 100, -1):
        assert torch.equal(GPT(GPTConfig(**kw, window_size=(left, 0)))(tokens), plain)
    # One token less is another model (wide weights: the window is visible in the logits).
    assert (GPT(GPTConfig(**kw, window_size=(14, 0)))(tokens) - plain).abs().max() > 1e-4


# -- Megatron-Core's GPTModel ------------------------------------------------------------------

MODEL = dict(vocab_size=100, seq_length=16, hidden_size=32, num_layers=4, num_attention_heads=4,
             init_std=0.3)  # fmt: skip
LLAMA = dict(normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             ffn_hidden_size=64, bias=False, untie_embeddings_and_output_weights=True,
             num_query_groups=2)  # fmt: skip
MCORE = {
    "gpt2-window-3": dict(window_size=(3, 0)),
    "llama-window-5": {**LLAMA, "window_size": (5, 0)},
    "llama-window-0-every-2nd-full": {**LLAMA, "window_size": (0, 0), "window_attn_skip_freq": 2},
    "gpt2-window-2-pattern": dict(window_size=(2, 0), window_attn_skip_freq=(0, 1, 1, 0)),
}


@pytest.fixture(scope="module")
def mcore():
    configs = [{**MODEL, **kw} for kw in MCORE.values()]
    return dict(zip(MCORE, launch(mcw.compare_all, 1, configs, timeout=300)[0], strict=True))


@pytest.mark.parametrize("name", list(MCORE))
def test_megatron_core_computes_megarts_logits_with_the_window(mcore, name):
    r = mcore[name]
    assert r["scale"] > 0.1
    assert r["forward"] < 1e-10 and r["reverse"] < 1e-10, r


def test_an_unbounded_window_goes_to_megatron_as_no_window():
    """--window-size -1,0 (every earlier token: megart's and Transformer Engine's reading) is
    written to Megatron's args as no window, since Megatron-Core's local spec reads (-1, 0)
    as a window masking every key: its model of the written args is megart's, its model of
    (-1, 0) another; megart's model is the same with either."""
    unbounded = {**MODEL, "window_size": (-1, 0), "window_attn_skip_freq": 2}
    args = megatron_args(GPTConfig(**unbounded), 0)
    assert (args.window_size, args.window_attn_skip_freq) == (None, None)
    written = dataclasses.asdict(megatron_config_from_args(vars(args)))
    as_given, as_written = launch(mcw.compare_all, 1, [unbounded, written], True, timeout=300)[0]
    assert as_written["forward"] < 1e-10 and as_written["reverse"] < 1e-10
    assert as_given["forward"] > 1e-3  # what writing (-1, 0) would have made of it
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, plain = GPT(GPTConfig(**unbounded)), GPT(GPTConfig(**MODEL))
    plain.load_state_dict(ours.state_dict())
    assert torch.equal(ours(x), plain(x))


# -- context parallelism -------------------------------------------------------------------------

CP = dict(vocab_size=300, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
          init_std=0.5, cp_comm_type="all_gather")  # fmt: skip


def test_cp2_and_cp4_are_the_one_process_model_by_global_positions():
    """float64, cw.against_one_process (test_context_parallel's): one layer with rope and GQA,
    and whole models, windows of 3 and 5 tokens (a rank's chunk of 16 is 2 to 4 tokens, so
    the window crosses chunks and ranks)."""
    attention = dict(CP, position_embedding="rotary", num_query_groups=2, window_size=(3, 0))
    models = [dict(CP, window_size=(3, 0)),
              dict(CP, **LLAMA, window_size=(5, 0), window_attn_skip_freq=2)]  # fmt: skip
    per_rank = launch(cw.against_one_process, 4, attention, models, timeout=120)
    worst = {k: max(r[k] for r in per_rank if k in r) for k in per_rank[0] | per_rank[-1]}
    assert len(worst) == 2 * (2 + 4 + 2 * 2)
    assert max(worst.values()) < 1e-12, worst


# -- training under every layout -------------------------------------------------------------------

TRAIN = dict(window_size="3,0", init_method_std=0.2, position_embedding_type="rope",
             group_query_attention=True, num_query_groups=2)  # fmt: skip


@pytest.fixture(scope="module")
def straight():
    return [h["loss"] for h in launch(tw.train_kw, 1, TRAIN, timeout=300)[0]]


def test_the_window_changes_the_curve(straight):
    """So that the layouts below following it shows the window applied."""
    plain = [h["loss"] for h in launch(tw.train_kw, 1, {**TRAIN, "window_size": None})[0]]
    assert abs(plain[-1] - straight[-1]) > 1e-3 * abs(plain[-1])


@pytest.mark.parametrize(
    "layout, world",
    [
        (dict(tensor_model_parallel_size=2, sequence_parallel=True), 2),
        (dict(pipeline_model_parallel_size=2), 2),
        (dict(context_parallel_size=2, cp_comm_type="all_gather"), 2),
    ],
    ids=["tp2-sp", "pp2", "cp2"],
)
def test_every_layout_follows_the_one_process_curve(straight, layout, world):
    for history in launch(tw.train_kw, world, {**TRAIN, **layout}, timeout=300):
        got = [h["loss"] for h in history]
        assert got == pytest.approx(straight, rel=5e-6, abs=0)


# -- flags ---------------------------------------------------------------------------------------


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_the_flags_reach_gpt_config_as_megatron_spells_them():
    cfg = parse("--window-size", "(7,0)", "--num-layers", "6",
                "--window-attn-skip-freq", "([1]*2+[0])*2").gpt_config()  # fmt: skip
    assert cfg.window_size == (7, 0) and cfg.window_attn_skip_freq == (1, 1, 0, 1, 1, 0)
    assert [cfg.layer_window(i) for i in range(6)] == [7, 7, None, 7, 7, None]
    every_third = parse("--window-size", "7,0", "--num-layers", "6",
                        "--window-attn-skip-freq", "3").gpt_config()  # fmt: skip
    assert [every_third.layer_window(i) for i in range(6)] == [7, 7, None, 7, 7, None]
    assert parse().gpt_config().window_size is None
    out = subprocess.run([sys.executable, "-m", "megart", "train", "--help"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    text = " ".join(out.stdout.split())
    assert "--window-size WINDOW_SIZE LEFT,RIGHT: sliding-window attention" in text
    assert "--window-attn-skip-freq WINDOW_ATTN_SKIP_FREQ with --window-size" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--window-size", "4,1"], "RIGHT .* must be 0; give --window-size 4,0"),
        (["--window-size", "4,-1"], "RIGHT .* must be 0"),
        (["--window-size", "4"], "give two numbers LEFT,RIGHT"),
        (["--window-size", "a,0"], "give two integers"),
        (["--window-size", "(-2,0)"], "at least 0, or -1"),
        (["--window-attn-skip-freq", "2"], "add --window-size"),
        (["--window-size", "3,0", "--window-attn-skip-freq", "0"], "N must be at least 1"),
        (["--window-size", "3,0", "--window-attn-skip-freq", "[1,0]"], "4 of them"),
        (["--window-size", "3,0", "--window-attn-skip-freq", "[1,2,1,1]"], "0 .* or 1"),
        (["--window-size", "3,0", "--window-attn-skip-freq", "__import__('os')"], "an integer"),
        (["--window-size", "3,0", "--window-attn-skip-freq", "[1]*99999999"], "an integer"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv).gpt_config()


def test_the_python_api_takes_megatron_cores_values_as_the_flags():
    # TransformerConfig's types: (left, right), and an int or a list per layer.
    for window, skip in (((7, 0), 3), ([7, 0], [1, 1, 0, 1, 1, 0]), ((7, 0), (1, 1, 0) * 2)):
        cfg = tw.tiny(num_layers=6, window_size=window, window_attn_skip_freq=skip).gpt_config()
        assert [cfg.layer_window(i) for i in range(6)] == [7, 7, None, 7, 7, None]
    with pytest.raises(ConfigError, match="--window-size 7.5: give the flag's text, or"):
        tw.tiny(window_size=7.5)
    with pytest.raises(ConfigError, match="--window-attn-skip-freq 0.5: give"):
        tw.tiny(window_size=(7, 0), window_attn_skip_freq=0.5)
    with pytest.raises(ConfigError, match="give two numbers LEFT,RIGHT"):
        tw.tiny(window_size=(7,)).gpt_config()


def test_hugging_face_formats_refuse_a_window_by_name():
    # Mistral's and Qwen3's formats write one: tests/test_hf_sliding_window.py.
    from megart.models import hf_gpt2, hf_llama

    llama = dict(MODEL, **LLAMA)
    for fmt, kw in ((hf_gpt2, MODEL), (hf_llama, llama)):
        fmt.check(GPTConfig(**kw, window_size=(-1, 0)))  # unbounded: no window
        with pytest.raises(ConfigError, match=r"cannot represent --window-size 3,0 \(sliding"):
            fmt.check(GPTConfig(**kw, window_size=(3, 0)))


def test_megatron_checkpoint_args_record_the_window_as_megatron_lm_does():
    from megart.training.megatron_args import config_from_args, megatron_args

    cfg = GPTConfig(**MODEL, window_size=(5, 0), window_attn_skip_freq=(1, 0, 1, 1))
    args = vars(megatron_args(cfg, iteration=1))
    assert args["window_size"] == (5, 0) and args["window_attn_skip_freq"] == [1, 0, 1, 1]
    back = config_from_args(args)
    assert (back.window_size, back.window_attn_skip_freq) == ((5, 0), (1, 0, 1, 1))
    older = {k: v for k, v in args.items() if not k.startswith("window")}
    assert config_from_args(older).window_size is None  # args from before the flags
