"""Vocab-parallel cross-entropy against F.cross_entropy (float64): loss and logits gradient,
for tp 1, 2 and 4, with ignored tokens and large logits."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import megart.tensor_parallel as tp
import tp_workers as w
from megart.launcher import launch


@st.composite
def ce_case(draw):
    n = draw(st.integers(1, 9))
    return (
        n,
        4 * draw(st.integers(1, 8)),  # vocabulary, divisible by every tp size tested
        draw(st.integers(0, 2 * n)),  # ignored tokens (of 2 n)
        draw(st.sampled_from([1.0, 30.0, 1000.0])),  # logit scale: exp would overflow at 1000
        draw(st.integers(0, 2**31 - 1)),
    )


# Each example is one launch of 4 ranks running several cases.
@settings(max_examples=2, deadline=None)
@given(st.lists(ce_case(), min_size=2, max_size=4))
def test_vocab_parallel_cross_entropy_matches_torch_for_tp_1_2_4(cases):
    assert launch(w.cross_entropy, 4, cases, timeout=180) == [4 * len(cases)] * 4


@settings(max_examples=20, deadline=None)
@given(ce_case())
def test_without_a_group_it_is_torch_cross_entropy(case):
    n, vocab, n_ignored, scale, seed = case
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * scale
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[: n_ignored // 2] = -100
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss = tp.vocab_parallel_cross_entropy(a, target, None)
    ref = F.cross_entropy(b, target, reduction="none")
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    (loss * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_half_precision_logits_are_computed_in_float32():
    logits = torch.randn(6, 16).bfloat16().requires_grad_()
    target = torch.tensor([0, 3, 15, -100, 7, 7])
    loss = tp.vocab_parallel_cross_entropy(logits, target, None)
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(logits.float(), target, reduction="none")
    torch.testing.assert_close(loss, ref)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad[3].abs().sum() == 0


def test_backward_may_run_twice():
    logits = torch.randn(3, 8, requires_grad=True)
    loss = tp.vocab_parallel_cross_entropy(logits, torch.tensor([1, 2, 3]), None).sum()
    first = torch.autograd.grad(loss, logits, retain_graph=True)[0]
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], first, rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([1, 2, 4]), ce_case())
def test_slice_helpers_add_up_to_the_full_vocabulary_one_hot(t, case):
    """The pieces both cross-entropies (unfused and megart.kernels' fused) build on: over the t
    slices of a vocabulary, each target's logit and its one-hot term appear on exactly one."""
    from megart.tensor_parallel.cross_entropy import (
        subtract_target_,
        target_in_slice,
        target_logits,
    )

    n, vocab, n_ignored, scale, seed = case
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * scale
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[: n_ignored // 2] = -100
    grad_loss = torch.randn(n, generator=gen, dtype=torch.float64)
    grad_loss[target == -100] = 0.0  # as both autograd Functions mask it
    kept = target != -100
    one_hot = F.one_hot(target.clamp(min=0), vocab).double() * kept[:, None]

    width = vocab // t  # ce_case's vocabulary is a multiple of 4
    summed = torch.zeros(n, dtype=torch.float64)
    grads = []
    for start in range(0, vocab, width):
        local, elsewhere = target_in_slice(target, start, width)
        piece = logits[:, start : start + width]
        summed += target_logits(piece, local, elsewhere)
        grads.append(subtract_target_(piece.clone(), local, elsewhere, grad_loss))
    assert torch.equal(summed, (logits * one_hot).sum(-1))
    expected = logits - one_hot * grad_loss[:, None]
    torch.testing.assert_close(torch.cat(grads, -1), expected, rtol=0, atol=0)
