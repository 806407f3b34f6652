"""The sliding-window masks (megart.models.window_masks): a query tile's band mask is its
definition (row r reads column c when r <= c <= r + left) and the rows of the whole sequence's
mask for the queries at positions left .., and both cached masks, first made under inference
mode, are normal tensors a training forward may keep for backward."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.models.window_masks import band_mask, sliding_causal_mask

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
