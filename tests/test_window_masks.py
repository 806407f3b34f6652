"""The sliding-window masks (megart.models.window_masks): a query tile's band mask is its
definition (row r reads column c when r <= c <= r + left) and the rows of the whole sequence's
mask for the queries at positions left .., and both cached masks, first made under inference
mode, are normal tensors a training forward may keep for backward."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.models.window import sequence_attention
from megart.models.window_masks import (
    band_mask,
    sliding_causal_bias,
    sliding_causal_mask,
    window_mask,
)
from megart.models.window_tiles import band_tile, tiled_window_attention

CPU = torch.device("cpu")


@settings(max_examples=80, deadline=None)
@given(tile=st.integers(1, 40), left=st.integers(0, 40))
def test_band_mask_is_its_definition_and_the_sequence_masks_rows(tile, left):
    got = band_mask(tile, left, CPU)
    want = [[r <= c <= r + left for c in range(tile + left)] for r in range(tile)]
    assert got.dtype == torch.bool
    assert got.tolist() == want
    assert torch.equal(got, sliding_causal_mask(tile + left, left, CPU)[left:])


def test_masks_first_made_in_inference_mode_are_normal_tensors():
    band_mask.cache_clear()
    sliding_causal_mask.cache_clear()
    with torch.inference_mode():
        made = band_mask(8, 3, CPU), sliding_causal_mask(8, 3, CPU)
    assert not any(m.is_inference() for m in made)
    assert band_mask(8, 3, CPU) is made[0]  # the cached tensor, reused outside inference mode


def _saved_masks(fn, dims=2):
    """(shape, storage) of the ``dims``-D tensors autograd keeps during ``fn()`` (2: the window
    masks; 4: the documents' masks, beside q, k and v)."""
    saved = []

    def pack(t):
        if t.dim() == dims and (dims == 2 or t.shape[1] == 1):
            saved.append((tuple(t.shape), t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


@pytest.mark.parametrize("seq,left", [(512, 300), (2048, 100)])  # one mask; query tiles
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_windowed_call_keeps_the_one_cached_bias_and_computes_as_the_boolean_mask(
    seq, left, dtype
):
    """Given a boolean mask, SDPA makes an s x s float copy per call and its backward keeps
    it; the cached bias is kept by reference instead (one storage however many layers), and
    the attention is bitwise the boolean masks' (the whole sequence's, or each tile's)."""
    q, k, v = (torch.randn(1, 2, seq, 8, dtype=dtype, requires_grad=True) for _ in "qkv")
    saved, outs = _saved_masks(lambda: [sequence_attention(q, k, v, 0.0, left) for _ in "ab"])
    assert len(saved) >= 2 and len({ptr for _, ptr in saved}) == 1, saved
    tile = band_tile(seq, left)
    if tile is None:
        positions = torch.arange(seq)
        allowed = window_mask(positions, positions, left)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, allowed)
    else:  # a mask of documents that allows all: each tile's boolean band
        everything = torch.ones(1, 1, seq, seq, dtype=torch.bool)
        want = tiled_window_attention(q, k, v, 0.0, left, tile, everything)
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)


def test_under_autocast_the_bias_is_made_in_autocasts_dtype():
    """CPU autocast runs SDPA in bf16 and casts a float32 bias to it, a copy per call; the
    bias is made in bf16 so that the cached one is kept."""
    q, k, v = (torch.randn(1, 2, 512, 8, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved, _ = _saved_masks(lambda: [sequence_attention(q, k, v, 0.0, 300) for _ in "ab"])
    assert len({ptr for _, ptr in saved}) == 1, saved
    assert sliding_causal_bias(512, 300, torch.bfloat16, CPU).data_ptr() == saved[0][1]


@pytest.mark.parametrize("window", [None, 300, 100])  # no window; one mask; query tiles
def test_a_documents_mask_is_one_bias_for_every_layer_and_attends_as_the_boolean_one(window):
    """The documents' [b, 1, s, s] mask, the same tensor for a chunk's layers, becomes one
    bias that every call without a window keeps (with a window each call's sum is its own);
    the attention is bitwise the boolean masks'."""
    seq = 1024 if window == 100 else 512
    q, k, v = (torch.randn(2, 2, seq, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    ids = torch.cat([torch.zeros(2, seq // 3), torch.ones(2, seq - seq // 3)], 1)
    documents = (ids.unsqueeze(-1) == ids.unsqueeze(-2)).unsqueeze(1)
    documents &= torch.ones(seq, seq, dtype=torch.bool).tril()
    saved, outs = _saved_masks(
        lambda: [sequence_attention(q, k, v, 0.0, window, documents) for _ in "ab"], dims=4
    )
    if window is None:
        assert len(saved) == 2 and len({ptr for _, ptr in saved}) == 1, saved
    positions = torch.arange(seq)
    allowed = documents & window_mask(positions, positions, window)
    tile = band_tile(seq, window) if window is not None else None
    if tile is None:
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, allowed)
        assert torch.equal(outs[0], want) and torch.equal(outs[1], want)
    else:  # per tile: against the whole mask, to rounding
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, allowed)
        assert (outs[0] - want).abs().max() < 1e-12
