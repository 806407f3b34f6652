"""What the fused ops share: whether megart's CUDA kernel serves a tensor, and how to hand the
kernel torch's dtype and current stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megart.errors import ConfigError

KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def cuda_kernel(name: str, *tensors: torch.Tensor) -> Callable[..., Any] | None:
    """megart._cuda's ``name`` when every tensor is on a GPU in a dtype the kernels take and
    megart was built with CUDA; None means "use the torch reference"."""
    if not all(t.is_cuda and t.dtype in KERNEL_DTYPES for t in tensors):
        return None
    try:
        from megart import _cuda
    except ImportError:
        return None
    return getattr(_cuda, name, None)


def launch(kernel: Callable[..., Any], like: torch.Tensor, *args: object) -> None:
    """Runs ``kernel(*args, dtype, stream)`` on ``like``'s device: tensors go by address (None as
    0), the dtype is ``like``'s, the stream torch's current one there, so the kernel runs in
    order with torch's work. This runs once per fused op and per backward, so it avoids what a
    fused op cannot afford beside torch's own: the Stream object torch.cuda.current_stream
    builds (it switches devices to do so) and a device switch when like's device is already
    current (the H200 profile in bench/RESULTS.md)."""
    index = like.device.index
    addresses = [
        a.data_ptr() if isinstance(a, torch.Tensor) else 0 if a is None else a for a in args
    ]
    stream = current_raw_stream(index)
    if torch.cuda.current_device() == index:
        kernel(*addresses, dtype_name(like), stream)
        return
    with torch.cuda.device(index):  # the binding launches on the current device
        kernel(*addresses, dtype_name(like), stream)


# torch's accessor for the current stream as an integer cudaStream_t (its compiled kernels'
# launcher uses it); private, so the public way stands in where a torch lacks it.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(index: int) -> int:
    """``torch.cuda.current_stream(index).cuda_stream``, without building the Stream."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def dtype_name(t: torch.Tensor) -> str:
    return KERNEL_DTYPES[t.dtype]


def common_dtype(op: str, *tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype all inputs are computed in: torch's promotion of theirs, as the unfused ops
    would give (under autocast with --fp32-residual-connection a bf16 activation meets the
    fp32 residual stream: fp32)."""
    present = [t for t in tensors if t is not None]
    dtype = present[0].dtype
    for t in present[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point:
        raise ConfigError(f"{op} takes floating-point tensors, not {dtype}")
    return dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs (the kernels' arithmetic), the input's own dtype otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
