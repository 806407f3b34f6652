"""Workers for tests/test_host_random.py: runs of megart train that report Python's and
numpy's global generator states."""

from __future__ import annotations

import pickle
import random

import numpy as np

import train_workers as tw


def states_after_loading(kw: dict) -> bytes:
    """Python's and numpy's generator states once the trainer is built (seeded, and a --load
    applied), pickled (numpy's state holds an array)."""
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    return pickle.dumps((random.getstate(), np.random.get_state()))
