"""Imported once by the launcher's fork server, never by a test (tests/conftest.py adds it to
the server's preload list as ``tests.rank_preload``: the server imports from the directory pytest
runs in): what every launched rank would otherwise redo is done here, before the fork.

megart.training.data.builtin_corpus sorts every path under the standard library (some 21,000)
to read its first .py files: 0.4 s of CPU on an idle CI core, 1.3 to 2.5 s on a loaded one, in
each rank of each launch that trains (the workers read ``builtin_corpus(1 << 16)``). Here it is
read once per corpus size, and each call returns a copy of that array, equal to what the
function itself returns (tests/test_training_parts.py checks the function itself, in the pytest
process, where nothing is replaced)."""

import functools

import numpy as np

import megart.training.data as data

_read = data.builtin_corpus


@functools.cache
def _corpus(max_bytes: int) -> np.ndarray:
    return _read(max_bytes)


@functools.wraps(_read)
def _builtin_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    return _corpus(max_bytes).copy()


data.builtin_corpus = _builtin_corpus
try:
    _corpus(1 << 16)  # the size the workers read
except OSError:  # no standard library sources: each rank raises it as before
    pass
