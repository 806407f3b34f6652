"""The pipeline engine, with real processes, against the same model in one process."""

import pytest
import torch

import pipeline_workers as pw
from megart.launcher import launch


def check_against_reference(results, m):
    ref_losses, ref_grads = pw.reference(m)
    losses = [r[0] for r in results if r[0]]
    assert losses and all(x == pytest.approx(ref_losses, rel=1e-12) for x in losses)
    seen = set()
    for _, grads, _ in results:
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-12, atol=1e-14)
            seen.add(name)
    assert seen == set(ref_grads)


@pytest.mark.parametrize(
    "kind, p, m, v",
    [
        ("gpipe", 2, 3, 1),
        ("1f1b", 4, 5, 1),
        ("1f1b", 2, 1, 1),
        ("interleaved", 2, 4, 2),
        ("interleaved", 2, 2, 4),
        ("zb-h1", 2, 3, 1),
        ("zb-v", 2, 4, 2),
        ("zb-v", 4, 8, 2),
    ],
)
def test_losses_and_gradients_equal_one_process(kind, p, m, v):
    results = launch(pw.run_stage, p, kind, p, m, v, 1, True, timeout=120)
    check_against_reference(results, m)


def test_scatter_gather_sends_exactly_one_tp_th_of_the_bytes():
    m = 4
    on = launch(pw.run_stage, 4, "1f1b", 2, m, 1, 2, True, timeout=120)
    off = launch(pw.run_stage, 4, "1f1b", 2, m, 1, 2, False, timeout=120)
    check_against_reference(on, m)
    check_against_reference(off, m)
    bytes_on, bytes_off = sum(r[2] for r in on), sum(r[2] for r in off)
    # Each of m activations and m gradients crosses the one stage boundary on both tp ranks.
    assert bytes_off == 2 * m * 2 * pw.BATCH * pw.HIDDEN * 8
    assert bytes_on * 2 == bytes_off
