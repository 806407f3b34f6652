"""Linear layers whose weight gradient can wait: the split backward of zero-bubble schedules.

A zero-bubble pipeline splits each backward into I (the gradient with respect to the stage's
input, which the previous stage is waiting for) and W (the weight gradients, needed only by the
optimizer). megart splits it per linear layer, where almost all of W's FLOPs are: while a
:class:`WeightGradStore` is active, a linear layer's backward computes only ``dX = dY W`` and
keeps ``(X, dY)``; W later computes ``dW = dY^T X`` (and the bias's ``dY`` sum) from them and
drops them. Each product is computed once, so the split does no work twice. Everything else
(norms, embeddings, tensor-parallel communication) runs in I as usual; its gradients are cheap.

W hands its gradients to autograd on the parameters themselves (``backward`` on a leaf), so they
accumulate into ``param.grad`` in place and the post-accumulate hooks fire once per microbatch,
as in an ordinary backward: the data-parallel buckets reduce after a parameter's last W.

The active store is process-wide rather than thread-local on purpose: on a GPU, autograd runs
backward on its own device threads, and a recomputed forward (activation checkpointing) runs
there too; it must see the store the engine set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch
import torch.nn.functional as F

_active: WeightGradStore | None = None


class WeightGradStore:
    """What W needs, per key (the engine's (microbatch, chunk)): each deferred linear layer's
    input and output gradient, and its parameters."""

    def __init__(self) -> None:
        self.key: Hashable | None = None  # the I being run; set by the engine
        self._pending: dict[Hashable, list[tuple]] = {}
        self.deferred = 0  # linear layers whose weight gradient an I left to a W
        # An input that requires grad and belongs to no parameter: it puts a layer whose input
        # needs no gradient (the model's first) into the graph without an edge to a parameter.
        self.anchor = torch.empty(0, requires_grad=True)

    @contextlib.contextmanager
    def input_grad(self, key: Hashable) -> Iterator[None]:
        """Runs an I: linear layers' weight gradients are kept for :meth:`weight_grad` (key)."""
        self.key = key
        self._pending.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def defer(self, x: torch.Tensor, dy: torch.Tensor, params: tuple) -> bool:
        """Keeps one linear layer's W for the running I; False when no I is running."""
        if self.key is None:
            return False
        self._pending[self.key].append((x, dy, params))
        self.deferred += 1
        return True

    def pending(self, key: Hashable) -> int:
        return len(self._pending.get(key, ()))

    def weight_grad(self, key: Hashable) -> None:
        """Runs the W of ``key``: every kept layer's weight (and bias) gradient, accumulated
        through autograd in one call; frees what I kept."""
        accumulate(self._pending.pop(key, []))

    def __len__(self) -> int:
        return sum(len(v) for v in self._pending.values())


def accumulate(kept: list[tuple]) -> None:
    """dW = dY^T X (and db = the sum of dY) of each kept (X, dY, (weight, bias)), added to the
    parameters' gradients by autograd itself, so post-accumulate hooks fire as usual."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for x, dy, (weight, bias) in kept:
        dy2 = dy.reshape(-1, dy.shape[-1])
        params.append(weight)
        grads.append(dy2.t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype))
        if bias is not None:
            params.append(bias)
            grads.append(dy2.sum(0).to(bias.dtype))
    if params:
        torch.autograd.backward(params, grads)


@contextlib.contextmanager
def deferring(store: WeightGradStore) -> Iterator[WeightGradStore]:
    """Makes ``store`` the active one for the duration (one pipeline iteration)."""
    global _active
    previous, _active = _active, store
    try:
        yield store
    finally:
        _active = previous


class _Linear(torch.autograd.Function):
    """y = x W^T + b whose backward returns dX now and leaves dW, db to the store's W.

    The parameters come in detached, with the parameters themselves in ``params``: an autograd
    edge to them would make I call their (empty) gradient accumulation, whose hooks count
    microbatches for the data-parallel buckets."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, params, anchor):  # noqa: ANN001, ANN205, ARG004
        device = x.device.type
        # Under autocast, compute in its dtype, as F.linear would; gradients go back to the
        # inputs' own dtypes (autocast's casts do that for F.linear).
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        xc = x.to(dtype)
        b = None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            y = F.linear(xc, weight.to(dtype), b)
        ctx.save_for_backward(xc)
        ctx.params, ctx.store, ctx.x_dtype = params, store, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        (xc,) = ctx.saved_tensors
        weight = ctx.params[0]
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(weight.to(dy.dtype)).to(ctx.x_dtype)
        if not ctx.store.defer(xc, dy, ctx.params):
            accumulate([(xc, dy, ctx.params)])  # outside an I (a plain B): now
        return dx, None, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except inside :func:`deferring` with gradients on, where the weight
    gradient is left to the store's W. Parameters must be leaves (they are, in megart)."""
    store = _active
    if store is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    detached = None if bias is None else bias.detach()
    return _Linear.apply(x, weight.detach(), detached, store, (weight, bias), store.anchor)
