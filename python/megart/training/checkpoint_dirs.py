"""What the --save and --load directories hold, checked before training starts: an unwritable
--save is refused before any work (not at the first save, after training ran), and a --load
directory that holds no checkpoint yet is the first run of a restartable job, not an error.
Also removes the ``iter_*.partial`` folders that crashed saves leave once a newer checkpoint is
complete, and the checkpoints --save-retain-interval does not keep."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from megart.errors import ConfigError
from megart.training.ckpt_files import TRACKER, iteration_dir

NON_PERSISTENT = "non_persistent"  # Megatron-LM's _NON_PERSISTENT_CKPT_SUBDIR of --save
ITER = re.compile(r"iter_(\d+)(\.partial)?$")


def check_writable(directory: str | os.PathLike) -> None:
    """Creates --save's directory and writes a file in it, raising ConfigError naming the
    directory when either fails. Every rank calls it (each writes its own file)."""
    path = Path(directory)
    probe = path / f".megart-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"--save {directory} cannot be written ({e.strerror or e}): choose a directory "
            "this user may create and write"
        ) from None


def loads_pretrained(load: str | None, pretrained: str | None) -> bool:
    """Whether a run starts from --pretrained-checkpoint (Megatron-LM's fine-tuning start):
    given, and --load not given or holding no checkpoint yet; --load's own checkpoint wins, so a
    restarted job resumes what it saved."""
    return bool(pretrained) and (not load or no_checkpoint_yet(load))


def no_checkpoint_yet(directory: str | os.PathLike) -> bool:
    """True when --load's directory is missing or holds neither a tracker file nor an
    ``iter_*`` checkpoint (crashed saves' ``.partial`` folders aside): nothing to resume, as on
    a restartable job's first run. A directory with checkpoints but no tracker is damaged and
    left to the loader's error."""
    path = Path(directory)
    if not path.is_dir():
        if path.exists():
            raise ConfigError(f"--load {directory} is a file; point it at a checkpoint directory")
        return True
    if (path / TRACKER).exists():
        return False
    return not any((m := ITER.match(p.name)) and not m.group(2) for p in path.iterdir())


def remove_stale_partials(directory: str | os.PathLike, complete: int) -> None:
    """Removes ``iter_N.partial`` folders with N below ``complete``, the iteration of a
    checkpoint just completed: what saves that crashed before it left."""
    for p in Path(directory).iterdir():
        m = ITER.match(p.name)
        if m and m.group(2) and int(m.group(1)) < complete:
            shutil.rmtree(p, ignore_errors=True)


def tracked_iteration(directory: str | os.PathLike) -> int | None:
    """The iteration the tracker file names, or None (no tracker, or a release checkpoint's)."""
    tracker = Path(directory) / TRACKER
    text = tracker.read_text().strip() if tracker.exists() else ""
    return int(text) if text.isdigit() else None


def retire(directory: str | os.PathLike, previous: int | None, latest: int, retain: int) -> None:
    """Megatron-LM's --save-retain-interval: once checkpoint ``latest`` is complete, the one
    the tracker named before it (``previous``) is deleted unless its iteration is a multiple of
    ``retain``. Only that one: checkpoints from before the flag was given stay, and so does a
    symbolic link (someone made it on purpose), as in Megatron."""
    if not previous or previous == latest or previous % retain == 0:
        return
    path = iteration_dir(directory, previous)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)


def non_persistent_dir(cfg: Any) -> Path:
    """Where non-persistent checkpoints are written."""
    return Path(cfg.non_persistent_global_ckpt_dir or Path(cfg.save) / NON_PERSISTENT)


# The flags resume_dir reads, unset (for a command line's flags before TrainConfig's defaults).
NON_PERSISTENT_FLAGS = dict(
    load=None, ckpt_step=None, non_persistent_ckpt_type=None, non_persistent_global_ckpt_dir=None
)


def resume_dir(cfg: Any) -> str | None:
    """The directory --load resumes from: --load, or its non-persistent directory (with
    --non-persistent-ckpt-type global) when that holds a checkpoint at least as recent."""
    if not cfg.load or cfg.non_persistent_ckpt_type != "global" or cfg.ckpt_step is not None:
        return cfg.load
    other = cfg.non_persistent_global_ckpt_dir or os.path.join(cfg.load, NON_PERSISTENT)
    newer = tracked_iteration(other) if Path(other).is_dir() else None
    persistent = tracked_iteration(cfg.load) if Path(cfg.load).is_dir() else None
    if newer is not None and (persistent is None or newer >= persistent):
        return str(other)
    return cfg.load


def remove_old_non_persistent(directory: Path) -> None:
    """Megatron-LM's cleanup before a non-persistent save: every complete checkpoint in
    ``directory`` but the newest is deleted."""
    if not directory.is_dir():
        return
    found = sorted(
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := ITER.match(p.name)) and not m.group(2) and p.is_dir()
    )
    for _, path in found[:-1]:
        shutil.rmtree(path, ignore_errors=True)
