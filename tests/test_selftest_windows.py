"""megart selftest's sliding-window check (megart.selftest.windows): windowed attention as a
layer runs it, tiled and through one mask, against the written-out definition in float64. On
this machine's CPU it passes; a band shifted by one token fails it, and so does a window one
token too wide on the single-mask path. On a GPU the same check runs in bf16 and fp16."""

import pytest
import torch

from megart.models import window, window_tiles
from megart.models.window_masks import band_bias, sliding_causal_bias
from megart.selftest import windows

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_both_paths_are_checked_and_pass_on_the_cpu():
    checks = windows.check_sliding_window(torch.device("cpu"))
    assert [c.name for c in checks] == [
        "sliding window query tiles float32",
        "sliding window one s x s mask float32",
    ]
    for c in checks:
        assert c.status == "pass" and c.error < 1e-5, c


def test_the_definition_is_float64_exact_for_megarts_path():
    q, k, v, dout = torch.randn(4, 1, 2, 600, 16, dtype=torch.float64)
    for left in (0, 50, 599):
        got = windows.windowed(q, k, v, dout, left)
        want = windows.definition(q, k, v, dout, left)
        for a, w in zip(got, want, strict=True):
            assert (a - w).abs().max() < 1e-12


def test_a_shifted_band_fails_the_tiled_check(monkeypatch):
    def shifted(tile, left, dtype, device):
        return band_bias(tile, left + 1, dtype, device)[:, 1:]

    monkeypatch.setattr(window_tiles, "band_bias", shifted)
    tiled, masked = windows.check_sliding_window(torch.device("cpu"))
    assert tiled.status == "fail" and masked.status == "pass", (tiled, masked)


def test_a_wider_window_fails_the_single_mask_check(monkeypatch):
    def wide(length, left, dtype, device):
        return sliding_causal_bias(length, left + 1, dtype, device)

    monkeypatch.setattr(window, "sliding_causal_bias", wide)
    tiled, masked = windows.check_sliding_window(torch.device("cpu"))
    assert masked.status == "fail" and tiled.status == "pass", (tiled, masked)


@GPU
def test_the_check_passes_on_this_gpu():
    for c in windows.check_sliding_window(torch.device("cuda")):
        assert c.status == "pass", c
