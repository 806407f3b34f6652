"""Finding NCCL at run time: megart never links it, so it installs and imports without it.

Search order: ``MEGART_NCCL_LIBRARY``; the nvidia-nccl-cu13 / nvidia-nccl-cu12 wheels; the copy
next to torch's libraries; the system's ``libnccl.so.2``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path

from megart._core import MegartError
from megart._core import comm as _comm

_SONAME = "libnccl.so.2"


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def nccl_candidates() -> list[str]:
    """Where megart looks for NCCL, in order. Paths that do not exist are left out, except the
    bare soname at the end, which the dynamic loader resolves through the system's paths."""
    found: list[str] = []
    explicit = os.environ.get("MEGART_NCCL_LIBRARY")
    if explicit:
        found.append(explicit)
    for site in _site_dirs():
        lib = site / "nvidia" / "nccl" / "lib" / _SONAME  # nvidia-nccl-cu12 and -cu13 wheels
        if lib.is_file():
            found.append(str(lib))
    # torch without looking inside it: importing torch just to find a path would be slow.
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        lib = Path(spec.origin).parent / "lib" / _SONAME
        if lib.is_file():
            found.append(str(lib))
    found.append(_SONAME)
    return list(dict.fromkeys(found))


def load_nccl() -> tuple[str, str]:
    """Loads NCCL; returns (path, version). Raises MegartError listing where it looked."""
    return _comm.load_nccl(nccl_candidates())


@functools.lru_cache(maxsize=1)
def find_nccl() -> tuple[str, str] | None:
    """(path, version) of the NCCL megart would use, or None when there is none."""
    try:
        return load_nccl()
    except MegartError:
        return None
