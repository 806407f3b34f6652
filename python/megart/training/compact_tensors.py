"""Tensors written to a checkpoint file each over a storage of its own bytes, without a copy.

torch.save writes a tensor's whole storage, once per file, and torch.load gives back every
tensor of one storage as a view of it. A parameter that is a view of a larger tensor (an
expert's weight under --moe-grouped-gemm, a slice of models.moe_grouped.pack's stack; any
parameter in the distributed optimizer's flat buffer) would then be written as one record of
the whole stack, and once loaded hold the whole stack alive: a reader that keeps or re-saves
one expert's weight (torch.save of a subset, a safetensors writer that refuses shared memory,
a per-tensor copy) holds or writes E times its bytes. :func:`compact` gives each such tensor
over a storage of exactly its bytes, aliasing the same memory (a slice of an
``UntypedStorage`` shares its memory and keeps the original alive): no copy on any device,
and the file is the one the same values in separate parameters give, byte for byte.
"""

from __future__ import annotations

from typing import Any

import torch


def compact_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` over a storage of exactly its bytes, sharing its memory, where ``t`` is a
    contiguous view of a larger storage; else ``t`` itself. A non-contiguous view is left as it
    is (its bytes are not one range; torch.save writes it with its strides, as without the
    view)."""
    storage = t.untyped_storage()
    size = t.numel() * t.element_size()
    if not t.is_contiguous() or storage.nbytes() == size or t.device.type == "meta":
        return t
    start = t.storage_offset() * t.element_size()
    own = storage[start : start + size]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(own, 0, t.shape, t.stride())


def compact(obj: Any) -> Any:
    """``obj`` (a checkpoint's state: dicts, lists and tuples of tensors and other values)
    with each tensor given by :func:`compact_tensor`; the containers rebuilt with their
    attributes (a state dict's ``_metadata``, which torch.save writes too), the values not
    copied."""
    if isinstance(obj, torch.Tensor):
        return compact_tensor(obj)
    if isinstance(obj, dict):
        out = type(obj)((k, compact(v)) for k, v in obj.items())
        if hasattr(obj, "__dict__"):  # a plain dict has no attributes
            out.__dict__.update(obj.__dict__)
        return out
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(compact(v) for v in obj)
    return obj
