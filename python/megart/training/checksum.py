"""A checksum per checkpoint file: written beside it when it is saved (``FILE.sha256``, in
``sha256sum``'s format, so ``sha256sum -c`` checks it by hand too) and verified when it is
loaded, so flipped bits or a truncated copy fail at load time naming the file, instead of
training on the damage. Files without one (older checkpoints) load unchecked."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from megart.errors import ConfigError

SUFFIX = ".sha256"
_CHUNK = 1 << 24


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def write(path: Path) -> None:
    """Records ``path``'s checksum beside it (atomically: a crash leaves none or a whole one)."""
    side = path.with_name(path.name + SUFFIX)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(f"{digest(path)}  {path.name}\n")
    os.replace(tmp, side)


def verify(path: Path) -> None:
    """Raises ConfigError naming ``path`` when it is empty or differs from its recorded
    checksum."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise ConfigError(
            f"{path} is empty (0 bytes): the save that wrote it was cut short or the file was "
            "truncated since; load an earlier checkpoint (--load DIR with its "
            "latest_checkpointed_iteration.txt naming one)"
        )
    side = path.with_name(path.name + SUFFIX)
    if not side.exists():
        return
    expected = side.read_text().split()[0] if side.read_text().strip() else ""
    actual = digest(path)
    if actual != expected:
        raise ConfigError(
            f"{path} is damaged: its SHA-256 is {actual[:16]}..., but {side.name} recorded "
            f"{expected[:16]}... when it was saved; restore the file or load an earlier checkpoint"
        )
