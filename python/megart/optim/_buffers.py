"""Turning torch tensors into the raw buffers megart's C++ and CUDA sweeps take."""

from __future__ import annotations

from typing import Any

import torch

from megart.errors import ConfigError

# The element types the sweeps understand, by the names the core uses.
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
LOW_PRECISION = (torch.bfloat16, torch.float16)


def dtype_name(dtype: torch.dtype, what: str) -> str:
    """The core's name for ``dtype``; ConfigError naming ``what`` when it is not supported."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ConfigError(
            f"{what} has dtype {dtype}; megart's optimizer supports float32, bfloat16 and float16"
        )
    return name


def check_device(tensor: torch.Tensor, what: str) -> str:
    """'cpu' or 'cuda' for ``tensor``; ConfigError for any other device."""
    kind = tensor.device.type
    if kind not in ("cpu", "cuda"):
        raise ConfigError(
            f"{what} is on device '{tensor.device}'; megart's optimizer runs on cpu (C++ sweep) "
            "or cuda (CUDA kernels) tensors only"
        )
    if tensor.is_sparse:
        raise ConfigError(f"{what} is sparse; megart's optimizer needs dense tensors")
    return kind


def cuda_built() -> bool:
    """Whether this install has megart's CUDA kernels (``megart._cuda``)."""
    try:
        from megart import _cuda  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_module() -> Any:
    """``megart._cuda``, or ConfigError saying that this install has no CUDA kernels."""
    try:
        from megart import _cuda
    except ImportError as e:
        raise ConfigError(
            "CUDA tensors need megart's CUDA kernels, but this install was built without a CUDA "
            "toolkit; rebuild megart where nvcc is found"
        ) from e
    return _cuda


def addresses(tensors: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


def sizes(tensors: list[torch.Tensor]) -> list[int]:
    return [t.numel() for t in tensors]
