"""Launched ranks for the tests of non-persistent checkpoints and --async-save: runs that die
mid-training, background writes held back until the test has changed the weights, and a
reader of a whole torch_dist store."""

from __future__ import annotations

import threading
from pathlib import Path

import train_workers as tw
from megart.training.data import builtin_corpus


def _trainer(kw: dict):
    from megart.training.trainer import Trainer

    return Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))


def killed_after(kw: dict, k: int) -> dict:
    """Trains until iteration ``k`` is done, then dies (an exception out of the loop, as a
    killed job leaves no final save): the figures, and what the trainer held then."""
    trainer = _trainer(kw)
    history = []
    try:
        for fig in trainer.iterations():
            history.append(fig)
            if fig["iteration"] == k:
                state = tw.held_state(trainer)
                raise KeyboardInterrupt("killed")
    except KeyboardInterrupt:
        pass
    return {"history": history, "held": state}


def _held_back(monkeypatch_target, release: threading.Event, entered: threading.Event):
    """Wraps dist_store.write_rank so that each background write waits for ``release``."""
    real = monkeypatch_target.write_rank

    def write_rank(*args, **kw):
        entered.set()
        assert release.wait(120), "the test never released the write"
        return real(*args, **kw)

    monkeypatch_target.write_rank = write_rank
    return real


def changed_after_the_snapshot(kw: dict) -> dict:
    """Trains, saves in the background with the write held back, then (the write still
    waiting) adds 1 to every weight and moment and draws from the random streams; only then
    lets the write go and finalizes. Returns what was held at the save, and what the folder
    and the tracker looked like while the write waited."""
    import torch

    from megart.training import dist_store

    trainer = _trainer(kw)
    history = trainer.train(quiet=True)
    held = tw.held_state(trainer)
    release, entered = threading.Event(), threading.Event()
    real = _held_back(dist_store, release, entered)
    try:
        done = history[-1]["iteration"] + 1  # a save of its own, after the run's
        trainer.save_checkpoint(done)
        assert entered.wait(60)
        save = Path(trainer.config.save)
        waiting = {
            "names": sorted(p.name for p in save.iterdir()),
            "tracker": (save / "latest_checkpointed_iteration.txt").read_text().strip(),
        }
        with torch.no_grad():
            for chunk in trainer.chunks:
                for p in chunk.parameters():
                    p.add_(1.0)
            for state in trainer.optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and value.is_floating_point():
                        value.add_(1.0)
        torch.rand(3)
        for name in trainer.rng.names():
            with trainer.rng.fork(name):
                torch.rand(3)
        release.set()
        trainer.saves.finish()
    finally:
        release.set()
        dist_store.write_rank = real
    return {"held": held, "waiting": waiting, "iteration": done}


def failing_in_training(kw: dict, fail_at: int) -> dict:
    """Trains with the background write held back until iteration ``fail_at`` raises (a
    failure in training while a save is in flight); returns the error's text."""
    from megart.training import dist_store

    trainer = _trainer(kw)
    release, entered = threading.Event(), threading.Event()
    real = _held_back(dist_store, release, entered)
    step = trainer.train_step

    import megart.distributed as dist

    def train_step(iteration: int):
        if iteration + 1 == fail_at:
            # The write goes on while the exception unwinds: other ranks' two seconds later,
            # so that rank 0 must wait for their files.
            threading.Timer(2.0 * (dist.get_rank() != 0), release.set).start()
            raise RuntimeError("a failure in training")
        return step(iteration)

    trainer.train_step = train_step
    try:
        trainer.train(quiet=True)
    except RuntimeError as e:
        return {"error": str(e)}
    finally:
        release.set()
        dist_store.write_rank = real
    return {"error": None}


def failing_write(kw: dict) -> dict:
    """Trains with every background write failing; returns the error training ends with."""
    from megart.training import dist_store

    real = dist_store.write_rank

    def write_rank(*args, **kw):
        raise OSError("disk full (simulated)")

    dist_store.write_rank = write_rank
    try:
        _trainer(kw).train(quiet=True)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        dist_store.write_rank = real
    return {"error": None}


def whole_store(root: str) -> dict:
    """Every key of the torch_dist store in ``root``: tensors whole, objects as saved."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megart.training.megatron_dist import load_store, stored

    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else None
        for key, meta in stored(Path(root)).items()
    }
    load_store(Path(root), state)
    return state
