"""A function whose output is dropped after its forward and made again in the backward, as
Megatron-Core's CheckpointWithoutOutput does (--recompute-modules layernorm): the function runs
without autograd keeping anything of its own, its output's memory is freed once the next
module has read it (the storage that module saved for its backward emptied in place), and a
gradient hook on that module's output runs the function again and refills the storage before
the module's backward reads it.

Unlike torch's checkpoint, which keeps the function's inputs and drops what it saves inside,
this also drops the output itself, which the following module saves (a norm's output is the
q/k/v projection's saved input). Tensors made from the output without autograd saving them
apart (sequence parallelism's gathered copy, autocast's 16-bit copy: what the column-parallel
products save, megart.tensor_parallel.column_entry) are dropped and refilled with it
(:meth:`DroppedOutput.also`).

Refilling copies storage to storage, which autograd's version counters do not see: the saved
tensors stay valid. Nothing here draws random numbers (norms), so no stream is replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _Run(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owner: DroppedOutput, *inputs: torch.Tensor) -> Any:
        with torch.no_grad():
            out = owner.fn(*inputs)
        ctx.save_for_backward(*inputs)
        ctx.owner = owner
        owner.ctx = ctx
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        owner = ctx.owner
        inputs, outputs = owner.recomputed()
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        owner.release()
        return (None, *(i.grad if i.requires_grad else None for i in inputs))


class DroppedOutput:
    """``fn``'s output (a tensor, or a tuple of tensors of which ``dropped`` are freed; the
    others, such as a fused norm's residual sum, are kept), freed by :meth:`discard` and made
    again when the gradient of the tensor given there is computed."""

    def __init__(self, fn: Callable[..., Any], dropped: tuple[int, ...] = (0,)) -> None:
        self.fn, self.dropped = fn, dropped
        self.ctx: Any = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.derived: list[tuple[torch.Tensor, int, Callable[[torch.Tensor], torch.Tensor]]] = []
        self._again: tuple[list[torch.Tensor], tuple[torch.Tensor, ...]] | None = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        device = inputs[0].device.type
        # The forward's autocast, to run the function again under it in the backward (which
        # runs outside autocast).
        self.autocast = (
            device,
            torch.get_autocast_dtype(device),
            torch.is_autocast_enabled(device),
        )
        out = _Run.apply(self, *inputs)
        self.outputs = out if isinstance(out, tuple) else (out,)
        return out

    def also(
        self, tensor: torch.Tensor, remake: Callable[[torch.Tensor], torch.Tensor], index: int = 0
    ) -> None:
        """Drops ``tensor`` too, a copy made from output ``index`` (``remake`` makes it again,
        without autograd), unless it shares that output's memory."""
        if tensor.untyped_storage()._cdata != self.outputs[index].untyped_storage()._cdata:
            self.derived.append((tensor, index, remake))

    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Frees the dropped outputs (and their copies); the output is made again when
        ``hook_tensor``'s gradient is, before the backward of what read it."""
        if not hook_tensor.requires_grad:  # no backward will come: nothing to drop
            return
        for t in [self.outputs[i] for i in self.dropped] + [d[0] for d in self.derived]:
            if not t.is_contiguous() or t.storage_offset():  # refilled storage to storage
                raise ValueError("DroppedOutput drops tensors that own their whole storage")
            t.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._refill)

    def _refill(self, grad: torch.Tensor) -> None:
        _, outputs = self.recomputed()
        with torch.no_grad():
            for i in self.dropped:
                _fill(self.outputs[i], outputs[i])
            for tensor, index, remake in self.derived:
                _fill(tensor, remake(outputs[index].detach()))

    def recomputed(self) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        """The function run again on the saved inputs, with autograd (once: the hook's run
        serves the backward)."""
        if self._again is None:
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in self.ctx.saved_tensors]
            device, dtype, enabled = self.autocast
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                out = self.fn(*inputs)
            self._again = (inputs, out if isinstance(out, tuple) else (out,))
        return self._again

    def release(self) -> None:
        self._again, self.ctx, self.outputs, self.derived = None, None, (), []


def _fill(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """``tensor``'s freed storage grown back and holding ``values`` (its shape, laid out
    contiguously), copied storage to storage: no version counter sees it."""
    nbytes = tensor.numel() * tensor.element_size()
    if values.untyped_storage().nbytes() != nbytes or not values.is_contiguous():
        values = values.contiguous().clone()  # a storage of its own, exactly the values
    storage = tensor.untyped_storage()
    storage.resize_(nbytes)
    storage.copy_(values.untyped_storage())
