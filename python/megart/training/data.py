"""Training data. The built-in corpus needs no download: the Python standard library's own
source files, read as bytes (a vocabulary of 256 byte values), on every machine that has
Python. Batches are a pure function of (seed, iteration), so every layout sees the same data."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from megart.errors import ConfigError
from megart.training.config import split_weights

BYTE_VOCAB = 256


def builtin_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """Up to ``max_bytes`` of the standard library's .py files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources under {root} for the built-in corpus")
    return np.concatenate(chunks)[:max_bytes]


def split_tokens(tokens: np.ndarray, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's --split: consecutive train, validation and test ranges of the corpus, sized
    by the weights. Cut by token position (Megatron cuts between documents); slices of a memory
    map stay memory maps."""
    train, valid, _ = split_weights(split)
    a = round(len(tokens) * train)
    b = a + round(len(tokens) * valid)
    return tokens[:a], tokens[a:b], tokens[b:]


class TokenDataset:
    """Random windows of ``seq_length + 1`` tokens from one long token array (a memory map of
    an indexed dataset stays one: only the windows drawn are read)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_length: int,
        vocab_size: int | None = None,
        name: str = "the corpus",
    ) -> None:
        if len(tokens) <= seq_length + 1:
            raise ConfigError(
                f"{name} has {len(tokens)} tokens; need more than seq_length + 1 = {seq_length + 1}"
            )
        self.tokens = tokens
        self.seq_length = seq_length
        self.vocab_size = vocab_size

    def global_batch(
        self, seed: int, iteration: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [size, seq_length]: the same for every rank and layout."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
        starts = torch.randint(0, len(self.tokens) - self.seq_length - 1, (size,), generator=g)
        windows = torch.from_numpy(
            np.stack([self.tokens[s : s + self.seq_length + 1] for s in starts.tolist()]).astype(
                np.int64
            )
        )
        if self.vocab_size is not None and int(windows.max()) >= self.vocab_size:
            raise ConfigError(
                f"token id {int(windows.max())} is outside --vocab-size {self.vocab_size}; set "
                "--vocab-size to the tokenizer's vocabulary size"
            )
        return windows[:, :-1], windows[:, 1:]
