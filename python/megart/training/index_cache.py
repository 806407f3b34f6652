"""--data-cache-path for ``--data-order megatron``: Megatron-Core's dataset indices built once.

Megatron-Core builds a dataset's indices on rank 0, saves them as .npy files under the cache
path, and has every other rank map them from there. So does megart: the arrays are written under
a name that hashes what they depend on (the data files' size and modification time among it, so
a changed dataset is not served stale indices), each file through a temporary name and the
description last, so that a complete set is the only one ever read; every rank then maps them
read-only, sharing the pages. Without --data-cache-path every rank builds them in memory.
The files are megart's (Megatron-Core's own cache files are not read).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import megart.distributed as dist
from megart.errors import ConfigError

FORMAT = 1  # bump when what the arrays mean changes


def data_files_stamp(prefix: str) -> list:
    """What identifies a prefix's data: its path and its .idx and .bin files' sizes and times."""
    out: list = [os.path.abspath(prefix)]
    for suffix in (".idx", ".bin"):
        st = os.stat(prefix + suffix)
        out += [st.st_size, st.st_mtime_ns]
    return out


def cached(
    directory: str | None,
    kind: str,
    description: dict[str, Any],
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """``build()``'s arrays; with a cache ``directory``, built by rank 0 only when no complete
    set for ``description`` is there, then mapped read-only by every rank."""
    if directory is None:
        return build()
    text = json.dumps({"format": FORMAT, "kind": kind, **description}, sort_keys=True)
    base = Path(directory) / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}-{kind}"
    done = base.with_suffix(".json")
    rank = dist.get_rank() if dist.is_initialized() else 0
    failure = None
    if rank == 0 and not done.exists():
        try:
            _write(base, done, build(), text)
        except Exception as e:  # noqa: BLE001 (raised below, after the other ranks are told)
            failure = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # rank 0's files complete (or its failure known) before any rank reads
    if failure is not None:
        raise failure
    if not done.exists():
        raise ConfigError(
            f"--data-cache-path {directory}: rank 0 wrote no indices there that this rank can "
            f"read ({done.name}): it failed (see its error), or the path is not on a file "
            "system every node shares; give a shared --data-cache-path or leave it out"
        )
    names = json.loads(done.read_text())["arrays"]
    return {name: np.load(f"{base}-{name}.npy", mmap_mode="r") for name in names}


def _write(base: Path, done: Path, arrays: dict[str, np.ndarray], text: str) -> None:
    """Each array through a temporary name, then the description: a complete set or none."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        tmp = Path(f"{base}-{name}.npy.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, f"{base}-{name}.npy")
    tmp = Path(f"{done}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"arrays": sorted(arrays), "description": json.loads(text)}))
    os.replace(tmp, done)
