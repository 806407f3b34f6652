"""What megart was built with and what it finds on this machine at run time."""

from __future__ import annotations

import ctypes
import platform
from typing import Any

from megart._core import __version__


def _cuda_module() -> Any:
    try:
        from megart import _cuda
    except ImportError:
        return None
    return _cuda


def gpu_count() -> int:
    """Number of CUDA GPUs visible through the driver; 0 without a driver or GPU."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def build_info() -> dict[str, Any]:
    """A dict describing this install.

    Keys: ``version``; ``cuda_compiled`` (the ``megart._cuda`` kernels were built);
    ``cuda_version`` (the toolkit they were built with, or None); ``gpu_available`` and
    ``gpu_count`` (from the driver, at run time); ``nccl_version`` and ``nccl_library`` (the NCCL
    that megart would load, or None); ``platform``.
    """
    from megart.distributed.nccl import find_nccl

    cuda = _cuda_module()
    gpus = gpu_count()
    nccl = find_nccl()
    return {
        "version": __version__,
        "cuda_compiled": cuda is not None,
        "cuda_version": cuda.toolkit_version() if cuda is not None else None,
        "gpu_available": gpus > 0,
        "gpu_count": gpus,
        "nccl_version": nccl[1] if nccl else None,
        "nccl_library": nccl[0] if nccl else None,
        "platform": f"{platform.system()}-{platform.machine()}",
    }
