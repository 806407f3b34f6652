"""Megatron-LM's indexed dataset format (``PREFIX.bin`` + ``PREFIX.idx``), memory-mapped.

``.bin`` holds the token ids of every sequence back to back. ``.idx`` (little-endian) holds:
the 9-byte magic ``MMIDIDX\\0\\0``, version (u64, 1), the token dtype's code (u8), the number of
sequences (u64) and of document boundaries (u64), then the tokens per sequence (int32 each),
each sequence's byte offset into ``.bin`` (int64 each) and the document boundaries as sequence
indices (int64 each, starting at 0). Files written by Megatron's preprocess_data.py load here,
and files written here load in Megatron. Training reads ``.bin`` as one token stream.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from megart.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's codes for the integer dtypes (6 and 7 are floating point, not token ids).
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def best_dtype(vocab_size: int) -> type[np.integer]:
    """The smallest dtype that holds every token id of the vocabulary."""
    return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.int32


class IndexedTokens:
    """A dataset written in Megatron's format: its sequences and the whole token stream, both
    memory-mapped (nothing is read until used)."""

    def __init__(
        self, prefix: str | os.PathLike, mmap: bool = True, flag: str = "--data-path"
    ) -> None:
        self.prefix = str(prefix)
        idx, bin_ = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path in (idx, bin_):
            if not path.exists():
                raise ConfigError(
                    f"{flag} {self.prefix}: {path} does not exist; give the prefix that "
                    "both .bin and .idx follow (megart preprocess-data writes them)"
                )
        with open(idx, "rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if head[: len(MAGIC)] != MAGIC[: len(head)] or not head:
            raise ConfigError(f"{idx} is not an index in Megatron's mmap format (bad magic)")
        if len(head) < len(MAGIC) + 25:
            raise ConfigError(
                f"{idx} is {len(head)} bytes, shorter than the {len(MAGIC) + 25}-byte header of "
                "Megatron's index format: the file is truncated; write it again (megart "
                "preprocess-data)"
            )
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC) :])
        if version != VERSION or code not in DTYPE_CODES:
            raise ConfigError(
                f"{idx}: version {version}, dtype code {code}; megart reads version {VERSION} "
                f"with integer token ids (codes {sorted(DTYPE_CODES)})"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = len(head)
        expected = offset + 12 * n_seq + 8 * n_doc
        if idx.stat().st_size != expected:
            raise ConfigError(
                f"{idx} is {idx.stat().st_size} bytes, but its header counts {n_seq} sequences "
                f"and {n_doc} document boundaries ({expected} bytes): the file is truncated or "
                "its counts are wrong; write it again (megart preprocess-data)"
            )
        index = np.memmap(idx, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, np.int32, n_seq, offset)
        self.pointers = np.frombuffer(index, np.int64, n_seq, offset + 4 * n_seq)
        self.document_indices = np.frombuffer(index, np.int64, n_doc, offset + 12 * n_seq)
        total = int(self.sizes.sum(dtype=np.int64))
        if bin_.stat().st_size != total * self.dtype.itemsize:
            raise ConfigError(
                f"{bin_} has {bin_.stat().st_size} bytes but its index describes {total} "
                f"tokens of {self.dtype} ({total * self.dtype.itemsize} bytes)"
            )
        if not total:
            self.tokens = np.zeros(0)
        elif mmap:
            self.tokens = np.memmap(bin_, mode="r", dtype=self.dtype)
        else:  # Megatron's --no-mmap-bin-files: read the tokens into memory once
            self.tokens = np.fromfile(bin_, dtype=self.dtype)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuses, naming the file, a dataset whose largest token id is not below
        ``vocab_size``: found once here (one pass over .bin), not when a batch reaches it."""
        if len(self.tokens) and np.dtype(self.dtype).itemsize * 8 > np.log2(vocab_size):
            largest = int(self.tokens.max())
            if largest >= vocab_size:
                raise ConfigError(
                    f"{self.prefix}.bin holds token id {largest}, outside --vocab-size "
                    f"{vocab_size}; set --vocab-size to the tokenizer's vocabulary size"
                )

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sizes[i])]


def write_indexed(
    prefix: str | os.PathLike, documents: Iterable[np.ndarray], dtype: type[np.integer]
) -> int:
    """Writes ``documents`` (one sequence each) as PREFIX.bin / PREFIX.idx; returns the number
    of tokens. Files are written under temporary names and renamed when complete."""
    code = {np.dtype(v): k for k, v in DTYPE_CODES.items()}.get(np.dtype(dtype))
    if code is None:
        raise ConfigError(f"token dtype {dtype} has no code in Megatron's format")
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)  # --output-prefix new/dir/name
    sizes: list[int] = []
    try:
        with open(prefix + ".bin.tmp", "wb") as data:
            for doc in documents:
                arr = np.asarray(doc)
                info = np.iinfo(dtype)
                if arr.size and (arr.min() < info.min or arr.max() > info.max):
                    raise ConfigError(f"token ids {arr.min()}..{arr.max()} do not fit {dtype}")
                data.write(arr.astype(dtype, copy=False).tobytes())
                sizes.append(arr.size)
        itemsize = np.dtype(dtype).itemsize
        pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64) * itemsize])
        with open(prefix + ".idx.tmp", "wb") as index:
            index.write(MAGIC + struct.pack("<QBQQ", VERSION, code, len(sizes), len(sizes) + 1))
            index.write(np.asarray(sizes, dtype=np.int32).tobytes())
            index.write(pointers[: len(sizes)].astype(np.int64).tobytes())
            index.write(np.arange(len(sizes) + 1, dtype=np.int64).tobytes())
    except BaseException:
        # A failed write (bad input, a full disk, ^C) leaves no half-written files behind.
        for suffix in (".bin.tmp", ".idx.tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(prefix + suffix)
        raise
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return int(sum(sizes))
