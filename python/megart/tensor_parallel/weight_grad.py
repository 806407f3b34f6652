"""Linear layers whose weight gradient megart computes itself: the split backward of zero-bubble
schedules, and gradient accumulation fusion.

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

Gradient accumulation fusion (Megatron-LM's, on by default there and here): inside
:func:`fusing_accumulation` a linear layer's weight gradient is added into ``param.grad`` by the
product itself (``grad += dY^T X`` with fp32 accumulation and output, cuBLAS's beta = 1), never
as a product in the compute dtype followed by a cast and an add. Under bf16/fp16 autocast with
fp32 weights that removes a cast and an add over every weight per microbatch (on an H200, 59 ms
of memory-bound kernels of a 1.2B GPT's bf16 iteration for 12 ms more in the products: 3.5-4%
faster; bench/grad_accum_fusion.py), and each microbatch's weight gradient is no longer rounded
to 16 bits before it is summed. The parameters' post-accumulate-grad hooks then run as
autograd's own accumulation runs them, once per backward, so the data-parallel buckets see no
difference. The weights' 16-bit copies are made once per region and reused by every
microbatch, as autocast's cast cache does. A GPT's output layer tied to the embedding of the
same chunk fuses its product but leaves the hooks to the embedding's accumulation, which
autograd runs after it (``linear``'s ``run_hooks``).

The active store is process-wide rather than thread-local on purpose: on a GPU, autograd runs
backward on its own device threads, and a recomputed forward (activation checkpointing) runs
there too; it must see the store the engine set. The fusion's state is process-wide for the
same reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # column_entry imports this module
    from megart.tensor_parallel.column_entry import WeightGradSlot

_active: WeightGradStore | None = None
_fusion: _Fusion | None = None  # set by fusing_accumulation()


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


def accumulate(kept: list[tuple], run_hooks: bool = True) -> None:
    """dW = dY^T X (and db = the sum of dY) of each kept (X, dY, (weight, bias)), added to the
    parameters' gradients: inside :func:`fusing_accumulation`, where ``.grad`` exists, by the
    product itself (then the parameters' post-accumulate hooks run, unless ``run_hooks`` is
    False: a tied weight's other use runs them); otherwise by autograd, so post-accumulate
    hooks fire as usual."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for x, dy, (weight, bias) in kept:
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if _fusion is not None and _fusable(weight, bias):
            with torch.no_grad():  # W runs outside backward, where grad mode is on
                _add_product(grad_of(weight), dy2, x2)
                if run_hooks:
                    _accumulated(weight)
                if bias is not None:
                    bias_grad = grad_of(bias)
                    bias_grad.add_(dy2.sum(0, dtype=bias_grad.dtype))
                    if run_hooks:
                        _accumulated(bias)
            continue
        if not run_hooks:
            raise RuntimeError(
                "a tied weight's gradient went missing between its forward and its backward"
            )
        params.append(weight)
        grads.append(dy2.t().mm(x2).to(weight.dtype))
        if bias is not None:
            params.append(bias)
            grads.append(dy2.sum(0).to(bias.dtype))
    if params:
        torch.autograd.backward(params, grads)


def fusing() -> bool:
    """Whether a :func:`fusing_accumulation` region is active."""
    return _fusion is not None


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer will read: ``param.main_grad`` where the weights are 16-bit
    and their fp32 gradients live apart (--half-weights, Megatron's ``main_grad``), else
    ``param.grad``."""
    main = getattr(param, "main_grad", None)
    return param.grad if main is None else main


def _fusable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # Only into gradients that exist (megart train's buffers): a missing one is autograd's to
    # create, as it would be without the fusion.
    return grad_of(weight) is not None and (bias is None or grad_of(bias) is not None)


# torch >= 2.8 has 16-bit products with an fp32 output on CUDA (addmm's out_dtype).
MIXED_PRODUCT = "dtype_out" in torch.ops.aten.addmm.overloads()


def _add_product(grad: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor) -> None:
    """grad += dy2^T x2, accumulated and written in grad's dtype."""
    if dy2.dtype == grad.dtype:
        grad.addmm_(dy2.t(), x2)
    elif not grad.is_cuda:  # torch's CPU has no mixed-dtype product; 16-bit values are exact
        grad.addmm_(dy2.t().to(grad.dtype), x2.to(grad.dtype))
    elif MIXED_PRODUCT:  # 16-bit inputs, fp32 C: one cuBLAS call with beta = 1
        torch.addmm(grad, dy2.t(), x2, out_dtype=grad.dtype, out=grad)
    else:  # an older torch: the unfused rounding, but the cast and the add in one kernel
        grad.add_(dy2.t().mm(x2))


def _accumulated(param: torch.Tensor) -> None:
    """Runs ``param``'s post-accumulate-grad hooks, as autograd's AccumulateGrad does after it
    adds into ``.grad`` (torch keeps them in this attribute of the tensor)."""
    for hook in list((param._post_accumulate_grad_hooks or {}).values()):
        hook(param)


class _Fusion:
    """The state of one :func:`fusing_accumulation` region: the weights' casts made in it."""

    def __init__(self) -> None:
        self.casts: dict[tuple[int, torch.dtype], tuple[int, torch.Tensor]] = {}

    def cast(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``param`` (detached) in ``dtype``, made once while ``param`` is unchanged."""
        if param.dtype == dtype:
            return param.detach()
        key = (id(param), dtype)
        version, cast = self.casts.get(key, (-1, None))
        if cast is None or version != param._version:
            cast = param.detach().to(dtype)
            self.casts[key] = (param._version, cast)
        return cast


def _cast(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _fusion.cast(param, dtype) if _fusion is not None else param.detach().to(dtype)


@contextlib.contextmanager
def fusing_accumulation(enabled: bool = True) -> Iterator[None]:
    """Adds linear layers' weight gradients into ``.grad`` by their product for the duration
    (see the module docstring); ``enabled=False`` does nothing (--no-gradient-accumulation-
    fusion). The 16-bit weight copies made in the region are freed when it ends."""
    global _fusion
    if not enabled:
        yield
        return
    previous, _fusion = _fusion, _Fusion()
    try:
        yield
    finally:
        _fusion = previous


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
    """y = x W^T + b whose backward returns dX now and leaves dW, db to the store's W (with no
    store: adds them now, see :func:`accumulate`).

    The parameters come only in ``params``, with no autograd edge: an edge would make I call
    their (empty) gradient accumulation, whose hooks count microbatches for the data-parallel
    buckets."""

    @staticmethod
    def forward(ctx, x, store, params, anchor, run_hooks=True, slot=None):  # noqa: ANN001, ANN205, ARG004
        device = x.device.type
        # Under autocast, compute in its dtype, as F.linear would; gradients go back to the
        # inputs' own dtypes (autocast's casts do that for F.linear).
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        xc = x.to(dtype)
        b = None if params[1] is None else _cast(params[1], dtype)
        with torch.autocast(device, enabled=False):
            y = F.linear(xc, _cast(params[0], dtype), b)
        ctx.save_for_backward(xc)
        ctx.params, ctx.store, ctx.x_dtype, ctx.run_hooks = params, store, x.dtype, run_hooks
        ctx.slot = slot
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        (xc,) = ctx.saved_tensors
        weight = ctx.params[0]
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(_cast(weight, dy.dtype)).to(ctx.x_dtype)
        if ctx.store is not None and ctx.store.defer(xc, dy, ctx.params):
            pass  # the running I's W computes it
        elif ctx.slot is not None:  # the entry's backward, beside its collective
            ctx.slot.keep((xc, dy, ctx.params), ctx.run_hooks)
        else:
            accumulate([(xc, dy, ctx.params)], ctx.run_hooks)  # outside an I (a plain B): now
        return dx, None, None, None, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    defer: bool = True,
    run_hooks: bool = True,
    slot: WeightGradSlot | None = None,
) -> torch.Tensor:
    """``F.linear``, except with gradients on inside :func:`deferring`, where the weight
    gradient is left to the store's W, or inside :func:`fusing_accumulation`, where it is
    added into ``.grad`` by its product. Parameters must be leaves (they are, in megart).

    ``defer=False`` keeps the weight gradient in the backward even inside :func:`deferring`.
    ``run_hooks=False`` is for a weight with another use in the same backward whose gradient
    autograd accumulates after this product's (a GPT's output layer tied to the embedding of
    the same chunk): autograd would sum both uses and run the hooks once, so the fused product
    leaves the hooks to that use; where it cannot fuse (no region, no ``.grad`` yet) this is
    plain ``F.linear``. It needs ``defer=False``: a W would come after that use's hooks.

    ``slot``: the column-parallel entry ``x`` came from (column_entry), whose backward computes
    the weight gradient while its collective is in flight, where no W takes it."""
    if defer and not run_hooks:
        raise ValueError("run_hooks=False needs defer=False: a W would run after the hooks")
    store = _active if defer else None
    fuse = _fusion is not None and (run_hooks or _fusable(weight, bias))
    # Only where the entry's backward will run (x needs a gradient), and where the product
    # could run here (with run_hooks=False only into an existing gradient, as fused).
    slot = slot if x.requires_grad and (run_hooks or fuse) else None
    wanted = store is not None or fuse or slot is not None
    if not (wanted and torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight, bias)
    anchor = _ANCHOR if store is None else store.anchor
    return _Linear.apply(x, store, (weight, bias), anchor, run_hooks, slot)


# Puts a layer whose input needs no gradient into the graph, as WeightGradStore.anchor does.
_ANCHOR = torch.empty(0, requires_grad=True)
