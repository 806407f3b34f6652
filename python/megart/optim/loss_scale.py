"""Dynamic loss scaling for fp16 training: scale the loss up so small gradients survive fp16,
unscale the gradients before the step, and skip the step (lowering the scale) when any gradient
overflowed to inf or NaN."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megart.errors import ConfigError
from megart.optim._buffers import (
    DTYPE_NAMES,
    addresses,
    check_device,
    cuda_built,
    cuda_module,
    dtype_name,
    sizes,
)


class LossScaler:
    """Megatron/torch-style dynamic loss scale.

    Each step: ``scaler.scale_loss(loss).backward()``, then ``scaler.step(optimizer)``, which
    unscales the gradients, skips the optimizer step if any was non-finite, and updates the
    scale as Megatron-Core's DynamicGradScaler does: every overflow restarts the count of
    overflow-free steps; the ``hysteresis``-th overflow since the scale last grew (or since the
    start) and each one after it multiply the scale by ``backoff_factor`` (not below
    ``min_scale``). After ``growth_interval`` overflow-free steps in a row the scale grows by
    ``growth_factor`` and the count of overflows starts again. A good step alone does not
    restart it, so overflows far apart still add up between two growths. ``hysteresis=1``
    lowers the scale at every overflow (as torch's GradScaler does).

    The scale lives on the host. On CUDA the optimizer kernels read the overflow flag on the
    device, and the scale update reads it once per step on the host (one synchronisation).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
    ) -> None:
        if not init_scale > 0.0 or not min_scale > 0.0:
            raise ConfigError("init_scale and min_scale must be positive")
        if not growth_factor > 1.0:
            raise ConfigError(f"growth_factor must exceed 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ConfigError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ConfigError(f"growth_interval must be at least 1, got {growth_interval}")
        if hysteresis < 1:
            raise ConfigError(
                f"hysteresis {hysteresis}: the scale backs off at this overflow since it last "
                "grew, so it must be at least 1 (1: at every overflow; Megatron's default is 2)"
            )
        self._scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.hysteresis = hysteresis
        self._good_steps = 0
        # Counts down at each overflow; the scale backs off at 0 and below (it goes on below 0
        # while overflows continue, as Megatron's tracker does).
        self._hysteresis_left = hysteresis

    @property
    def scale(self) -> float:
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale_(self, params: list[torch.Tensor], num_threads: int = 0) -> torch.Tensor:
        """Divides the gradients of ``params`` by the scale in place. Returns an int32 flag tensor
        (on the first gradient's device) that is 1 when any gradient had an inf or NaN."""
        grads = [p.grad for p in params if p.grad is not None]
        for g in grads:
            check_device(g, "a gradient")
        return multi_tensor_scale_(grads, grads, 1.0 / self._scale, num_threads)

    def step(self, optimizer: torch.optim.Optimizer, num_threads: int = 0) -> bool:
        """Unscales, steps ``optimizer`` unless a gradient overflowed, updates the scale.
        Returns whether the step was taken. ``optimizer`` must accept ``found_inf=`` in its step
        (megart's Adam and AdamW do)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        found = self.unscale_(params, num_threads)
        optimizer.step(found_inf=found)
        overflow = bool(found.item())
        self.update(overflow)
        return not overflow

    def update(self, overflow: bool) -> None:
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._good_steps += 1
        # >=, not Megatron's ==: a state resumed under a smaller --loss-scale-window still grows.
        if self._good_steps >= self.growth_interval:
            self._scale *= self.growth_factor
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis

    @property
    def hysteresis_tracker(self) -> int:
        """Megatron's hysteresis tracker: the overflow that brings it to 0 or below backs the
        scale off."""
        return self._hysteresis_left

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "good_steps": self._good_steps,
            "hysteresis_tracker": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        # States written before megart had hysteresis: a fresh tracker, as a new Megatron
        # scaler starts with.
        self._hysteresis_left = int(state.get("hysteresis_tracker", self.hysteresis))


def scale_path(device_type: str, dtype: torch.dtype, contiguous: bool, cuda_kernels: bool) -> str:
    """Which implementation multi_tensor_scale_ uses for one (device, dtype) group: "core" (the
    C++ sweep, CPU), "cuda" (the multi-tensor kernel: every dtype it takes, so fp16 gradients do
    not fall back to torch's per-tensor ops) or "torch" (anything else: other dtypes, strided
    tensors, other devices, an install without CUDA kernels)."""
    if not contiguous or dtype not in DTYPE_NAMES:
        return "torch"
    if device_type == "cpu":
        return "core"
    if device_type == "cuda" and cuda_kernels:
        return "cuda"
    return "torch"


def multi_tensor_scale_(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    scale: float,
    num_threads: int = 0,
) -> torch.Tensor:
    """outputs[i] = inputs[i] * scale (in place when they are the same tensors), many tensors
    per call. Returns an int32 flag of one element on inputs[0]'s device, 1 when any input held
    an inf or NaN (the fp16 loss-scaling check), so CUDA callers need no host sync. Contiguous
    CPU tensors go through megart's C++ sweep, contiguous float32, bfloat16 and float16 CUDA
    tensors (fp16 gradients included) through its multi-tensor kernel (run on
    one H200, 2026-11-26), the rest through torch (see scale_path)."""
    from megart import _core

    if len(inputs) != len(outputs):
        raise ConfigError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            raise ConfigError(
                f"tensor {i}: output {tuple(y.shape)} {y.dtype} on {y.device} does "
                f"not match input {tuple(x.shape)} {x.dtype} on {x.device}"
            )
        groups.setdefault((x.device, x.dtype), []).append(i)
    device = inputs[0].device if inputs else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.int32, device=device)
    for (dev, dtype), index in groups.items():
        xs, ys = [inputs[i] for i in index], [outputs[i] for i in index]
        contiguous = all(t.is_contiguous() for t in xs + ys)  # the sweeps take numel() from each
        path = scale_path(dev.type, dtype, contiguous, dev.type == "cuda" and cuda_built())
        if path == "core":
            name = dtype_name(dtype, "a tensor")
            if _core.optim.scale(addresses(xs), addresses(ys), sizes(xs), name, scale, num_threads):
                found.fill_(1)
        elif path == "cuda":
            name = dtype_name(dtype, "a tensor")
            flag = torch.zeros(1, dtype=torch.int32, device=dev)
            with torch.cuda.device(dev):  # the launch goes to the current device
                stream = torch.cuda.current_stream(dev).cuda_stream
                cuda_module().multi_tensor_scale(
                    addresses(xs), addresses(ys), sizes(xs), name, scale, flag.data_ptr(), stream
                )
            found = torch.maximum(found, flag.to(device))
        else:
            bad = torch.stack([~torch.isfinite(x).all() for x in xs]).any()
            for x, y in zip(xs, ys, strict=True):
                torch.mul(x, scale, out=y)
            found = torch.maximum(found, bad.to(device=device, dtype=torch.int32).reshape(1))
    return found
