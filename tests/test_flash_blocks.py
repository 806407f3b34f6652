"""megart.models.flash_blocks: one block of ring attention by torch's flash kernels. Two blocks
of keys folded by their log-sum-exp, and each block's backward given the folded output and
log-sum-exp, are the attention over both blocks and its gradients (float64 on the CPU; bf16
against float64 on a GPU). On a GPU with dropout, a block's forward and backward are torch's
own flash attention and its autograd under the same random seed: the backward replays the
forward's mask."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.models import flash_blocks

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA's kernels)")


def two_blocks(q, k, v, dout, causal_first: bool):
    """Keys split in two blocks, each by flash_blocks, folded; then each block's backward."""
    half = k.shape[2] // 2
    parts = [
        (k[:, :, :half], v[:, :, :half], causal_first),
        (k[:, :, half:], v[:, :, half:], False),
    ]
    outs = [flash_blocks.forward(q, kb, vb, causal, 0.0) for kb, vb, causal in parts]
    lse = torch.logaddexp(outs[0][1], outs[1][1])
    out = sum(o.to(lse.dtype) * torch.exp(l - lse).unsqueeze(-1) for o, l, _ in outs)
    out = out.to(q.dtype)
    grads = [flash_blocks.backward(dout, q, kb, vb, out, lse, causal, 0.0, saved)
             for (kb, vb, causal), (_, _, saved) in zip(parts, outs, strict=True)]  # fmt: skip
    dq = grads[0][0].double() + grads[1][0].double()
    dk = torch.cat([grads[0][1], grads[1][1]], 2)
    dv = torch.cat([grads[0][2], grads[1][2]], 2)
    return [out, dq, dk, dv]


def reference(q, k, v, dout, causal_first: bool):
    """float64: one attention over both blocks (the first block's keys causal to the rows if
    ``causal_first``, the second's all seen)."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    half = k.shape[2] // 2
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal_first:
        mask[:, :half] = torch.ones(q.shape[2], half, dtype=torch.bool).tril()
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    y.backward(dout.double().cpu())
    return [y, q.grad, k.grad, v.grad]


def draw(seed: int, b: int, h: int, n: int, d: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(b, h, 2 * n, d, generator=g, dtype=torch.float64) for _ in "kv")
    return [t.to(device, dtype) for t in (q, k, v, dout)]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 2), h=st.integers(1, 3),
       n=st.integers(1, 9), d=st.integers(1, 8), causal_first=st.booleans())  # fmt: skip
def test_folded_blocks_and_their_backwards_are_the_whole_attention_in_float64(
    seed, b, h, n, d, causal_first
):
    q, k, v, dout = draw(seed, b, h, n, d, "cpu", torch.float64)
    got, want = two_blocks(q, k, v, dout, causal_first), reference(q, k, v, dout, causal_first)
    for a, w in zip(got, want, strict=True):
        assert (a - w).abs().max() < 1e-12


def test_the_kernels_take_cuda_half_types_and_the_cpu_without_dropout():
    assert flash_blocks.usable(torch.zeros(1, 1, 2, 3), 0.0)
    assert not flash_blocks.usable(torch.zeros(1, 1, 2, 3), 0.1)


@GPU
@pytest.mark.parametrize("causal_first", [True, False])
def test_on_a_gpu_folded_bf16_blocks_are_the_whole_attention_in_float64(causal_first):
    q, k, v, dout = draw(3, 2, 4, 256, 64, "cuda", torch.bfloat16)
    got, want = two_blocks(q, k, v, dout, causal_first), reference(q, k, v, dout, causal_first)
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
