"""Multi-tensor operations: many tensors in few kernel launches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megart.errors import ConfigError


def _check(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    if len(inputs) != len(outputs):
        raise ConfigError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    for i, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            raise ConfigError(
                f"tensor {i}: output {tuple(y.shape)} {y.dtype} on {y.device} does "
                f"not match input {tuple(x.shape)} {x.dtype} on {x.device}"
            )
        if not (x.is_contiguous() and y.is_contiguous()):
            raise ConfigError(f"tensor {i} is not contiguous; call .contiguous() first")


def multi_tensor_scale_(
    inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], scale: float
) -> bool:
    """outputs[i] = inputs[i] * scale; returns True when any input holds inf or NaN (the
    fp16 loss-scaling check). float32 CUDA tensors use megart's kernel; others use torch."""
    _check(inputs, outputs)
    if not inputs:
        return False
    # The kernel takes every tensor by address on one device: all on inputs[0]'s GPU.
    device = inputs[0].device
    on_gpu = device.type == "cuda" and all(
        x.dtype == torch.float32 and x.device == device for x in inputs
    )
    if on_gpu:
        try:
            from megart import _cuda
        except ImportError:
            on_gpu = False
    if not on_gpu:
        found = any(not bool(torch.isfinite(x).all()) for x in inputs)
        for x, y in zip(inputs, outputs, strict=True):
            torch.mul(x, scale, out=y)
        return found
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    with torch.cuda.device(device):  # the launch goes to the current device
        _cuda.multi_tensor_scale(
            [x.data_ptr() for x in inputs],
            [y.data_ptr() for y in outputs],
            [x.numel() for x in inputs],
            float(scale),
            flag.data_ptr(),
            torch.cuda.current_stream(device).cuda_stream,
        )
    return bool(flag.item())
