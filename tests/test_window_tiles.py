"""Sliding-window attention in query tiles (megart.models.window_tiles): output and gradients
equal a float64 reference written from the definition and the single s x s mask path (GQA,
documents, every tile length); sequence_attention takes the tiles when the window is short
(their SDPA calls are exactly band_tiles', their entries scored_entries'); with dropout the mean
over draws is the attention without it and a query reads nothing outside its window; no tensor
of s x s elements is made forward or backward at s = 4096, LEFT = 255."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from megart.models import window_tiles as wt
from megart.models.window import sequence_attention
from megart.models.window_masks import ALIGN, band_mask, sliding_causal_mask


def reference(q, k, v, left, ids=None):
    """softmax over keys max(0, i - left)..i (of query i's document) of q_i k_j / sqrt(d),
    times v, one query at a time ([b, heads, s, d], float64)."""
    b, heads, s, d = q.shape
    rows = []
    for i in range(s):
        keys = torch.arange(max(0, i - left), i + 1)
        scores = torch.einsum("bhd,bhkd->bhk", q[:, :, i], k[:, :, keys]) / math.sqrt(d)
        if ids is not None:  # other documents' keys out
            scores = scores.masked_fill((ids[:, keys] != ids[:, i : i + 1])[:, None], -math.inf)
        rows.append(torch.einsum("bhk,bhkd->bhd", scores.softmax(-1), v[:, :, keys]))
    return torch.stack(rows, 2)


def inputs(b, heads, groups, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    kv = [torch.randn(b, groups, s, d, generator=g, dtype=torch.float64, requires_grad=True)
          for _ in range(2)]  # fmt: skip
    return q, *kv, g


def repeat(x, heads):  # each group's key/value head once per query head, as Attention does
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def grads(out, leaves, g):
    seed = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, leaves, seed, retain_graph=True)


@settings(max_examples=60, deadline=None)
@given(
    heads_groups=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 1)]),
    b=st.integers(1, 2),
    s=st.integers(1, 40),
    left=st.integers(0, 20),
    tile=st.integers(1, 24),
    documents=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tiles_equal_the_definition_and_the_single_mask_in_float64(
    heads_groups, b, s, left, tile, documents, seed
):
    heads, groups = heads_groups
    q, k, v, g = inputs(b, heads, groups, s, 4, seed)
    q2 = q * 3  # peaked attention: a wrong key shows
    ids = torch.randint(0, 3, (b, s), generator=g).sort(-1).values if documents else None
    docs = None if ids is None else (ids[:, :, None] == ids[:, None, :])[:, None]
    tiled = wt.tiled_window_attention(q2, repeat(k, heads), repeat(v, heads), 0.0, left, tile,
                                      docs)  # fmt: skip
    allowed = sliding_causal_mask(s, left, q.device)
    allowed = allowed if docs is None else docs & allowed
    single = F.scaled_dot_product_attention(q2, repeat(k, heads), repeat(v, heads), allowed)
    want = reference(q2, repeat(k, heads), repeat(v, heads), left, ids)
    for got in (tiled, single):
        assert (got - want).abs().max() < 1e-13
    seed_grads = torch.Generator().manual_seed(seed)
    want_grads = grads(want, (q, k, v), seed_grads)
    for got in (tiled, single):
        got_grads = grads(got, (q, k, v), torch.Generator().manual_seed(seed))
        for a, w in zip(got_grads, want_grads, strict=True):
            assert (a - w).abs().max() < 1e-12


class CountCalls:
    """Wraps torch's scaled_dot_product_attention (as window_tiles and window call it),
    recording each call's (queries, keys)."""

    def __init__(self, monkeypatch):
        self.calls = []
        sdpa = F.scaled_dot_product_attention

        def counted(q, k, *args, **kwargs):
            self.calls.append((q.shape[2], k.shape[2]))
            return sdpa(q, k, *args, **kwargs)

        monkeypatch.setattr(wt.F, "scaled_dot_product_attention", counted)


@pytest.mark.parametrize(("s", "left"), [(64, 3), (61, 5), (40, 0), (29, 7)])
def test_sequence_attention_tiles_a_short_window_as_band_tiles_says(monkeypatch, s, left):
    monkeypatch.setattr(wt, "TILE_FLOOR", 4)
    tile = wt.band_tile(s, left)
    count = CountCalls(monkeypatch)
    q, k, v, _ = inputs(2, 2, 2, s, 4, 0)
    got = sequence_attention(q, k, v, 0.0, left)
    if tile is None:  # (29, 7): 2 (8 + 7) > 29, one s x s mask
        assert (s, left) == (29, 7) and count.calls == [(s, s)]
    else:
        tiles = wt.band_tiles(s, left, tile)
        assert count.calls == [(n, a + n - first) for a, n, first in tiles]
        assert wt.scored_entries(s, left, tile) <= s * (tile + left)
    assert sum(qn * kn for qn, kn in count.calls) == wt.scored_entries(s, left, tile)
    assert (got - reference(q, k, v, left)).abs().max() < 1e-13


def test_tile_choice():
    assert wt.band_tile(131072, 4095) == 4096  # Mistral's window: T = LEFT + 1
    assert wt.band_tile(4096, 255) == wt.TILE_FLOOR == 256
    assert wt.band_tile(1023, 256) is None  # 2 (257 + 256) > 1023: one mask
    assert wt.band_tile(1026, 256) == 257
    assert wt.band_tile(100, -1) is None
    assert wt.scored_entries(10, 3, None) == 100


def test_dropout_is_unbiased_and_stays_in_the_window(monkeypatch):
    """Over 3000 draws the mean output is the attention without dropout (within 5 standard
    errors, from the draws' own spread), and perturbing every key and value outside the last
    query's window leaves that query's output alone under the same draws."""
    s, left, tile = 24, 3, 4
    q, k, v, _ = inputs(1, 2, 2, s, 4, 1)
    q, k, v = q.detach(), k.detach(), v.detach()
    exact = wt.tiled_window_attention(q, k, v, 0.0, left, tile)
    torch.manual_seed(0)
    draws = torch.stack([wt.tiled_window_attention(q, k, v, 0.3, left, tile)
                         for _ in range(3000)])  # fmt: skip
    err = draws.std(0) / math.sqrt(len(draws))
    assert ((draws.mean(0) - exact).abs() <= 5 * err + 1e-12).all()
    assert (draws[0] - exact).abs().max() > 1e-3  # dropout did drop
    far = torch.arange(s) < s - 1 - left
    k2, v2 = k.clone(), v.clone()
    k2[:, :, far], v2[:, :, far] = 7.0, -5.0
    torch.manual_seed(1)
    one = wt.tiled_window_attention(q, k, v, 0.3, left, tile)
    torch.manual_seed(1)
    two = wt.tiled_window_attention(q, k2, v2, 0.3, left, tile)
    assert torch.equal(one[:, :, -1], two[:, :, -1])


class Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.most = max(self.most, x.numel())
        return out


def test_no_s_by_s_tensor_at_4096_with_a_window_of_255():
    s, left, d = 4096, 255, 8
    tile = wt.band_tile(s, left)
    assert tile == 256
    q, k, v, _ = inputs(1, 1, 1, s, d, 0)
    sliding_causal_mask.cache_clear()
    band_mask.cache_clear()
    wt.band_bias.cache_clear()
    saved = []
    with (
        Largest() as largest,
        torch.autograd.graph.saved_tensors_hooks(
            lambda x: saved.append(x.numel()) or x, lambda x: x
        ),
    ):
        out = sequence_attention(q, k, v, 0.0, left)
        out.sum().backward()
    # A tile's scores (T x (T + left), the cached bias's rows padded to ALIGN) or a whole
    # [s, d] tensor: nothing near s x s.
    bound = max(s * d, tile * -(-(tile + left) // ALIGN) * ALIGN)
    assert largest.most <= bound < s * s // 100, largest.most
    assert max(saved) <= bound
    assert sum(saved) < 8 * s * (tile + left)  # every tile's saved tensors: O(s (T + left))


@pytest.mark.parametrize("skip", [None, (1, 0, 1)])
def test_a_gpt_in_tiles_is_the_gpt_with_one_mask_in_float64(monkeypatch, skip):
    """A Llama-style GPT (rope, GQA) at s = 64, LEFT = 5: logits and gradients with 4-token tiles
    (TILE_FLOOR lowered) equal those with one s x s mask (the floor as shipped: no tiles)."""
    from megart.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_length=64, hidden_size=32, num_layers=3,
                    num_attention_heads=4, num_query_groups=2, position_embedding="rotary",
                    init_std=0.5, window_size=(5, 0), window_attn_skip_freq=skip)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).double()
    tokens = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))

    def run():
        model.zero_grad()
        logits = model(tokens)
        logits.square().sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    assert wt.band_tile(64, 5) is None
    want, want_grads = run()
    monkeypatch.setattr(wt, "TILE_FLOOR", 4)
    assert wt.band_tile(64, 5) == 6
    got, got_grads = run()
    assert (got - want).abs().max() < 1e-12
    for a, w in zip(got_grads, want_grads, strict=True):
        assert (a - w).abs().max() <= 1e-10 * max(1.0, w.abs().max().item())
