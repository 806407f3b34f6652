"""Shared pieces of the optimizer tests: parameter sets, gradient streams, closeness."""

from __future__ import annotations

import torch

# Odd sizes (one element, a few, one past a power of two), a 0-d tensor and a matrix.
SHAPES = [(1,), (7,), (4097,), (), (33, 65)]


def make_params(shapes=SHAPES, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]


def clone_params(params):
    return [p.detach().clone().requires_grad_(True) for p in params]


def set_grads(param_lists, seed):
    """Gives every list the same fresh gradients (one list per optimizer under test)."""
    gen = torch.Generator().manual_seed(seed)
    for tensors in zip(*param_lists, strict=True):
        g = torch.randn(tensors[0].shape, generator=gen)
        for p in tensors:
            p.grad = g.to(p.dtype, copy=True)


def assert_trajectory_close(actual, expected, rtol=1e-6):
    """Elementwise |a - e| <= rtol * (|e| + max|e|): relative to each element, with the tensor's
    scale as the floor. A plain per-element relative bound cannot hold near zero crossings: torch's
    own fused and for-loop AdamW differ there by 1e-5 relative after 40 steps, because torch's
    vectorised sqrt is not correctly rounded."""
    for a, e in zip(actual, expected, strict=True):
        a = a.detach().float()
        e = e.detach().float()
        scale = e.abs().max().item() if e.numel() else 0.0
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * scale)
