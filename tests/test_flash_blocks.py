"""megart.models.flash_blocks: one block of ring attention by torch's flash kernels (through
megart selftest's check of them, megart.selftest.ring_blocks). Two blocks of keys folded by
their log-sum-exp, and each block's backward given the folded output and log-sum-exp, are the
attention over both blocks and its gradients (float64 on the CPU; bf16 against float64 on a
GPU). On a GPU with dropout, a block's forward and backward are torch's own flash attention
and its autograd under the same random seed: the backward replays the forward's mask."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.models import flash_blocks
from megart.selftest import ring_blocks

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA's kernels)")


def draw(seed, b, h, n, d, device, dtype):
    return ring_blocks.draw(seed, (b, h, n, d), torch.device(device), dtype)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 2), h=st.integers(1, 3),
       n=st.integers(1, 9), d=st.integers(1, 8), causal_first=st.booleans())  # fmt: skip
def test_folded_blocks_and_their_backwards_are_the_whole_attention_in_float64(
    seed, b, h, n, d, causal_first
):
    q, k, v, dout = draw(seed, b, h, n, d, "cpu", torch.float64)
    got, want = (
        ring_blocks.folded(q, k, v, dout, causal_first),
        ring_blocks.whole(q, k, v, dout, causal_first),
    )
    for a, w in zip(got, want, strict=True):
        assert (a - w).abs().max() < 1e-12


def test_the_kernels_take_cuda_half_types_and_the_cpu_without_dropout():
    assert flash_blocks.usable(torch.zeros(1, 1, 2, 3), 0.0)
    assert not flash_blocks.usable(torch.zeros(1, 1, 2, 3), 0.1)


def test_the_selftest_check_passes_here_and_fails_a_wrong_fold(monkeypatch):
    """megart selftest's check on this machine's CPU passes; with the blocks' backward given
    each block's own output (not the folded one) it fails, naming the flag that avoids it."""
    cpu = torch.device("cpu")
    (good,) = ring_blocks.check_ring_blocks(cpu)
    assert good.status == "pass" and good.error < 1e-5, good
    real = flash_blocks.backward

    def own_output(dout, q, k, v, out, lse, causal, dropout, saved):
        mine, my_lse, _ = flash_blocks.forward(q, k, v, causal, 0.0)
        return real(dout, q, k, v, mine, my_lse, causal, dropout, saved)

    monkeypatch.setattr(flash_blocks, "backward", own_output)
    (bad,) = ring_blocks.check_ring_blocks(cpu)
    assert bad.status == "fail" and "--cp-comm-type all_gather" in bad.detail, bad


@GPU
@pytest.mark.parametrize("causal_first", [True, False])
def test_on_a_gpu_folded_bf16_blocks_are_the_whole_attention_in_float64(causal_first):
    q, k, v, dout = draw(3, 2, 4, 256, 64, "cuda", torch.bfloat16)
    got, want = (
        ring_blocks.folded(q, k, v, dout, causal_first),
        ring_blocks.whole(q, k, v, dout, causal_first),
    )
    for a, w in zip(got, want, strict=True):
        assert (a.double().cpu() - w).abs().max() <= 2e-2 * w.abs().max()


@GPU
def test_on_a_gpu_the_backward_replays_the_forwards_dropout():
    """torch's flash attention with dropout 0.3 and its autograd, against flash_blocks.forward
    and backward from the same seed: the same output (so the same mask) and the same
    gradients up to the order of the backward's sums (so the backward used that mask; another
    mask changes a third of the probabilities); and dropout did drop."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout = draw(4, 2, 4, 128, 64, "cuda", torch.bfloat16)
    k, v = k[:, :, :128].contiguous(), v[:, :, :128].contiguous()
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(1)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want = F.scaled_dot_product_attention(*x, dropout_p=0.3, is_causal=True)
    want.backward(dout)
    torch.manual_seed(1)
    out, lse, saved = flash_blocks.forward(q, k, v, True, 0.3)
    grads = flash_blocks.backward(dout, q, k, v, out, lse, True, 0.3, saved)
    assert torch.equal(out, want)
    for g, t in zip(grads, x, strict=True):  # flash's backward adds dq atomically, in any order
        assert (g - t.grad).abs().max() <= 1e-2 * t.grad.abs().max()
    undropped = flash_blocks.forward(q, k, v, True, 0.0)[0]
    assert not torch.equal(out, undropped)
