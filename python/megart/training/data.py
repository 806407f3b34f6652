"""Training data. The built-in corpus needs no download: the Python standard library's own
source files, read as bytes (a vocabulary of 256 byte values), on every machine that has
Python. Batches are a pure function of (seed, iteration), so every layout sees the same data."""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megart.errors import ConfigError
from megart.training.data_checks import DEFAULT_SPLIT, split_weights
from megart.training.indexed import IndexedTokens

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


def split_tokens(
    tokens: np.ndarray, split: str | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def parse_blend(data_path: str | Sequence[str]) -> list[tuple[float | None, str]]:
    """Megatron's --data-path: one PREFIX, ``W1 PREFIX1 W2 PREFIX2 ...`` (a blend with those
    weights), or ``PREFIX1 PREFIX2 ...`` (a blend weighted by the datasets' sizes: weight None).
    """
    items = [data_path] if isinstance(data_path, str) else list(data_path)
    if len(items) == 1:
        return [(1.0, items[0])]

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    weights = [number(w) for w in items[0::2]]
    if len(items) % 2 == 0 and all(w is not None for w in weights):
        if min(weights) < 0 or sum(weights) <= 0:
            raise ConfigError(
                f"--data-path weights {weights} must be non-negative with a positive sum"
            )
        return list(zip(weights, items[1::2], strict=True))
    if any(number(p) is not None for p in items):
        raise ConfigError(
            f"--data-path {' '.join(items)}: give one prefix, weight-prefix pairs "
            "(W1 PREFIX1 W2 PREFIX2 ...) or prefixes only (weighted by their sizes)"
        )
    return [(None, p) for p in items]


class BlendedDataset:
    """Samples drawn from several datasets in proportion to their weights, as Megatron's
    blended --data-path: each sample of a global batch picks its dataset at random with those
    probabilities (from a generator seeded by the seed and the iteration, so batches stay a
    pure function of both), then a window of that dataset."""

    def __init__(self, parts: Sequence[TokenDataset], weights: Sequence[float]) -> None:
        self.parts = list(parts)
        self.weights = torch.tensor(weights, dtype=torch.float64) / float(sum(weights))
        self.seq_length = parts[0].seq_length

    def global_batch(
        self, seed: int, iteration: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + iteration + 500_009)
        which = torch.multinomial(self.weights, size, replacement=True, generator=g)
        inputs = torch.empty(size, self.seq_length, dtype=torch.int64)
        targets = torch.empty_like(inputs)
        for k, part in enumerate(self.parts):
            rows = (which == k).nonzero().flatten()
            if len(rows):
                # Each dataset's windows from its own stream: seed offset by its position.
                x, y = part.global_batch(seed + 7919 * (k + 1), iteration, len(rows))
                inputs[rows], targets[rows] = x, y
        return inputs, targets


Dataset = TokenDataset | BlendedDataset


def _opened(
    data_path: str | Sequence[str], vocab_size: int, mmap: bool, flag: str = "--data-path"
) -> list[tuple[float | None, str, np.ndarray]]:
    """--data-path's forms (parse_blend) opened: (weight or None, prefix, tokens) each, every
    dataset's ids checked against the vocabulary; ``flag`` names the paths in errors."""
    opened = [(w, p, IndexedTokens(p, mmap, flag)) for w, p in parse_blend(data_path)]
    for _, _, data in opened:
        data.check_vocab(vocab_size)
    return [(w, p, data.tokens) for w, p, data in opened]


def _blend(parts: list[TokenDataset], weights: list[float]) -> Dataset:
    return parts[0] if len(parts) == 1 else BlendedDataset(parts, weights)


def build_datasets(
    data_path: str | Sequence[str] | None,
    split: str | None,
    seq_length: int,
    vocab_size: int,
    tokens: np.ndarray | None = None,
    evaluate: bool = True,
    mmap: bool = True,
) -> tuple[Dataset, Dataset | None, Dataset | None]:
    """The training, validation and test datasets: ``tokens`` (or --data-path's datasets, or
    the built-in corpus) cut by --split, each dataset of a blend on its own, as Megatron cuts
    them. Without ``evaluate`` validation and test are None, and test is None when the split
    gives it no tokens; a range too short for one sample is a ConfigError naming it."""
    if tokens is not None or not data_path:
        sources = [(1.0, "", tokens if tokens is not None else builtin_corpus())]
    else:
        sources = [(w, f" of {p}", t) for w, p, t in _opened(data_path, vocab_size, mmap)]
    ranges = [split_tokens(t, split) for _, _, t in sources]
    # Weighted by the training ranges' sizes when --data-path gives no weights.
    weights = [len(r[0]) if w is None else w for (w, _, _), r in zip(sources, ranges, strict=True)]
    hint = f" of --split {split or DEFAULT_SPLIT!r} (or set --eval-iters 0)"
    kinds = (("training", ""), ("validation", hint), ("test", hint))
    out: list[Dataset | None] = []
    for i, (kind, why) in enumerate(kinds):
        if i and (not evaluate or (i == 2 and not any(len(r[2]) for r in ranges))):
            out.append(None)  # a test weight of 0 leaves no test range
            continue
        parts = [
            TokenDataset(r[i], seq_length, vocab_size, f"the {kind} split{name}{why}")
            for (_, name, _), r in zip(sources, ranges, strict=True)
        ]
        out.append(_blend(parts, weights))
    return out[0], out[1], out[2]


def build_split_datasets(
    paths: Sequence[str | Sequence[str] | None],
    seq_length: int,
    vocab_size: int,
    evaluate: bool = True,
    mmap: bool = True,
) -> tuple[Dataset, Dataset | None, Dataset | None]:
    """Megatron-LM's --train-data-path, --valid-data-path and --test-data-path (``paths``, in
    that order): each split its own dataset or blend, in --data-path's forms, read whole (no
    --split cuts it). A split without a path has no dataset (Megatron then neither validates
    nor tests), nor do validation and test without ``evaluate``; prefixes without weights are
    weighted by their datasets' sizes."""
    flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
    out: list[Dataset | None] = []
    for i, (flag, path) in enumerate(zip(flags, paths, strict=True)):
        if not path or (i and not evaluate):
            out.append(None)
            continue
        opened = _opened(path, vocab_size, mmap, flag)
        parts = [TokenDataset(t, seq_length, vocab_size, f"{flag} {p}") for _, p, t in opened]
        out.append(_blend(parts, [len(t) if w is None else w for w, _, t in opened]))
    if out[0] is None:
        raise ConfigError("--train-data-path is missing: training reads its dataset")
    return out[0], out[1], out[2]
