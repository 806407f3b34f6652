"""Megatron-Core's sample order for indexed datasets (``--data-order megatron``).

Megatron-Core's GPTDataset cuts a dataset's sequences into train/valid/test ranges by --split
(by sequence index), repeats the range for as many epochs as the requested samples need,
shuffles the sequences of each epoch with numpy's RandomState(--seed) (the last epoch on its
own when it supplies under 80% of an epoch's samples), cuts the concatenation into windows of
seq_length + 1 tokens that overlap by one token, and shuffles the windows with the same random
state. A blend (BlendedDataset) takes sample i from the dataset whose share so far lags its
weight most. These are the same arrays here, built in numpy (megatron_blend.py has the blends
and the sample counts)."""

from __future__ import annotations

import numpy as np

from megart.training.data_checks import split_weights
from megart.training.index_cache import cached, data_files_stamp
from megart.training.indexed import IndexedTokens

# GPTDataset: a final epoch that supplies fewer than this share of an epoch's samples is
# shuffled on its own, so that its few samples do not all land in the last batches' mix.
SEPARATE_FINAL_EPOCH_BELOW = 0.80


def split_bookends(split: str | None) -> list[tuple[float, float] | None]:
    """--split "969,30,1" as Megatron's split matrix: each split's [begin, end) fraction of the
    sequences (None for an empty split), the weights normalized in float64 (split_weights, which
    also takes None for Megatron's default) and accumulated left to right, as Megatron's."""
    ends = [0.0]
    for f in split_weights(split):
        ends.append(ends[-1] + f)
    return [(a, b) if b > a else None for a, b in zip(ends[:-1], ends[1:], strict=True)]


def split_sequences(n: int, bookend: tuple[float, float]) -> np.ndarray:
    """The sequence indices of one split of ``n`` sequences (Megatron rounds both ends)."""
    return np.arange(
        int(round(bookend[0] * float(n))), int(round(bookend[1] * float(n))), dtype=np.int32
    )


def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """The epochs whose tokens cover ``num_samples`` windows of seq_length + 1 tokens."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def document_index(
    documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """The sequences of every epoch, shuffled together (or the last epoch apart)."""
    if separate_final and epochs > 1:
        first = document_index(documents, epochs - 1, rng, False)
        return np.concatenate((first, document_index(documents, 1, rng, False)))
    out = np.tile(documents.astype(np.int32), epochs)
    rng.shuffle(out)
    return out


def sample_index(
    sizes: np.ndarray, doc_index: np.ndarray, seq_length: int, tokens_per_epoch: int, epochs: int
) -> np.ndarray:
    """[samples + 1, 2]: where each window starts, as (position in ``doc_index``, token
    offset in that sequence); window k starts at token k * seq_length of the epochs'
    concatenation (windows share their last token with the next's first). The helper's loop
    in Megatron-Core, vectorised: a start is placed in the sequence that holds it (a start at a
    sequence's end stays in that sequence, empty sequences hold none)."""
    samples = (epochs * tokens_per_epoch - 1) // seq_length
    starts = np.arange(samples + 1, dtype=np.int64) * seq_length
    ends = np.concatenate(([0], np.cumsum(sizes[doc_index], dtype=np.int64)))
    where = np.searchsorted(ends, starts, side="right") - 1
    out = np.stack((where, starts - ends[where]), axis=1)
    out[0] = 0  # the helper starts at (0, 0) even before empty sequences
    return out


def shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, first) followed by one of [first, total)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


def indices(
    data: IndexedTokens, documents: np.ndarray, num_samples: int | None, seed: int, seq_length: int
) -> dict[str, np.ndarray]:
    """GPTDataset's three arrays for one dataset's split: the shuffled sequences of every
    epoch, where each window starts, and the windows' shuffled order."""
    sizes = np.asarray(data.sizes, dtype=np.int64)
    per_epoch = int(np.sum(sizes[documents]))
    epochs = num_epochs(per_epoch, num_samples, seq_length)
    separate = False
    before_final = 0
    if epochs > 1:
        before_final = ((epochs - 1) * per_epoch - 1) // seq_length
        per_epoch_samples = (per_epoch - 1) // seq_length
        from_final = num_samples - before_final
        separate = from_final < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch_samples)
    rng = np.random.RandomState(seed)
    doc_index = document_index(documents, epochs, rng, separate)
    samples = sample_index(sizes, doc_index, seq_length, per_epoch, epochs)
    total = len(samples) - 1
    shuffled = shuffle_index(before_final if separate else total, total, rng)
    return {"document_index": doc_index, "sample_index": samples, "shuffle_index": shuffled}


class GPTOrder:
    """One dataset's split in Megatron-Core's GPTDataset order: ``sample(i)`` is its i-th
    window of seq_length + 1 tokens (inputs are the first seq_length, labels the last)."""

    def __init__(
        self,
        data: IndexedTokens,
        documents: np.ndarray,
        num_samples: int | None,
        seed: int,
        seq_length: int,
        cache: str | None = None,
    ) -> None:
        self.data, self.seq_length = data, seq_length
        first = int(documents[0]) if len(documents) else 0
        self.description = {
            "data": data_files_stamp(data.prefix),
            "documents": [first, len(documents)],  # a split's contiguous range
            "num_samples": num_samples,
            "seed": seed,
            "seq_length": seq_length,
        }
        arrays = cached(
            cache,
            "GPTDataset",
            self.description,
            lambda: indices(data, documents, num_samples, seed, seq_length),
        )
        self.doc_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle)

    def sample(self, i: int) -> np.ndarray:
        """The i-th window (int64, seq_length + 1 tokens)."""
        k = int(self.shuffle[i])
        (d0, off0), (d1, off1) = self.sample_index[k], self.sample_index[k + 1]
        if d0 == d1:
            return self.data[int(self.doc_index[d0])][off0 : off1 + 1].astype(np.int64)
        parts = [self.data[int(self.doc_index[d0])][off0:]]
        parts += [self.data[int(self.doc_index[d])] for d in range(d0 + 1, d1)]
        parts.append(self.data[int(self.doc_index[d1])][: off1 + 1])
        return np.concatenate(parts).astype(np.int64)
