"""Megatron-Core's blends and sample counts for ``--data-order megatron``: which GPTDataset
splits a --data-path (or per-split path) builds, with how many samples each, and the
BlendedDataset order over them (megatron_order.py has one dataset's order)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from megart.errors import ConfigError
from megart.training.index_cache import cached
from megart.training.indexed import IndexedTokens
from megart.training.megatron_order import GPTOrder, split_bookends, split_sequences

SPLITS = ("train", "valid", "test")
# Megatron-LM's --mid-level-dataset-surplus: each dataset of a weighted blend builds this share
# more samples than its weight asks for.
SURPLUS = 0.005


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` samples: the dataset it comes from (int16) and that dataset's sample
    (int64). Each sample goes to the dataset whose weight times the samples so far (at least 1)
    exceeds its count so far the most (the first on ties), in float64 as Megatron-Core's
    helper: a sequential rule, so it runs in megart's C++ core (a long run's blend has ~1e9
    samples; a Python loop took 0.84 s per million)."""
    from megart import _core

    return _core.data.blending_indices([float(x) for x in weights], int(size))


def normalize(weights: Sequence[float]) -> list[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_megatron_blend(path: str | Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's reading of a --data-path list: an even count of weight-prefix pairs (weights
    are numbers), else prefixes only (weights None), as get_blend_from_list."""
    items = [path] if isinstance(path, str) else [str(p) for p in path]
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            return [p.strip() for p in items], None
        return [p.strip() for p in items[1::2]], weights
    return [p.strip() for p in items], None


class BlendOrder:
    """Megatron-Core's BlendedDataset: ``size`` samples drawn from ``parts`` by weight."""

    def __init__(
        self,
        parts: Sequence[GPTOrder],
        weights: Sequence[float],
        size: int,
        cache: str | None = None,
    ) -> None:
        self.parts = list(parts)
        w = normalize(weights)
        description = {"parts": [p.description for p in self.parts], "weights": w, "size": size}

        def build() -> dict[str, np.ndarray]:
            which, nth = blending_indices(w, size)
            return {"dataset_index": which, "dataset_sample_index": nth}

        arrays = cached(cache, "BlendedDataset", description, build)
        self.which, self.nth = arrays["dataset_index"], arrays["dataset_sample_index"]
        # One pass over the (possibly ~1e9-long) index, not one per dataset.
        counts = np.bincount(self.which, minlength=len(self.parts))
        for k, (part, wanted) in enumerate(zip(self.parts, counts.tolist(), strict=True)):
            if wanted > len(part):
                raise ConfigError(
                    f"the blend asks dataset {k} for {wanted} samples, more than its "
                    f"{len(part)}: give more data or fewer --train-iters / --eval-iters"
                )

    def __len__(self) -> int:
        return len(self.which)

    def sample(self, i: int) -> np.ndarray:
        return self.parts[int(self.which[i])].sample(int(self.nth[i]))


Order = GPTOrder | BlendOrder


def num_samples(config) -> tuple[int, int, int]:  # noqa: ANN001 (TrainConfig: no cycle)
    """Megatron-LM's get_train_valid_test_num_samples: train --train-iters global batches;
    validation --eval-iters batches (of --eval-global-batch-size, by default the global
    batch) at each of train_iters // eval_interval + 1 evaluations; test --eval-iters
    batches."""
    gbs, eval_gbs = config.global_batch_size, config.eval_batch_sizes[0]
    evals = config.train_iters // config.eval_interval + 1
    return (config.train_iters * gbs, evals * config.eval_iters * eval_gbs,
            config.eval_iters * eval_gbs)  # fmt: skip


def build_orders(
    path: str | Sequence[str],
    bookends: list[tuple[float, float] | None],
    sizes: Sequence[int | None],
    seed: int,
    seq_length: int,
    opened: dict[str, IndexedTokens],
    mmap: bool = True,
    cache: str | None = None,
) -> list[Order | None]:
    """One blend's three splits (None where ``bookends`` or ``sizes`` has none), as
    BlendedMegatronDatasetBuilder builds them."""
    prefixes, weights = parse_megatron_blend(path)
    data = [
        opened[p] if p in opened else opened.setdefault(p, IndexedTokens(p, mmap)) for p in prefixes
    ]

    def gpt(d: IndexedTokens, i: int, n: int | None) -> GPTOrder:
        documents = split_sequences(len(d), bookends[i])
        if not np.any(np.asarray(d.sizes)[documents]):
            # Megatron-Core would count epochs of no tokens for ever.
            begin, end = bookends[i]
            raise ConfigError(
                f"{d.prefix}: its {SPLITS[i]} split (the sequences from {begin:.4g} to "
                f"{end:.4g} of its {len(d)}, --split) holds no token, but Megatron's order "
                f"needs {n if n is not None else 'an epoch of'} samples from it; give more "
                "sequences, another --split, or --eval-iters 0 for an empty validation or "
                "test split"
            )
        return GPTOrder(d, documents, n, seed, seq_length, cache)

    out: list[Order | None] = []
    for i, bookend in enumerate(bookends):
        if bookend is None or sizes[i] is None:
            out.append(None)
        elif len(prefixes) == 1 and weights is None:
            out.append(gpt(data[0], i, sizes[i]))
        elif weights is not None:
            w = normalize(weights)
            target = [math.ceil(sizes[i] * x) for x in w]
            parts = [
                gpt(d, i, math.ceil(t * (1 + SURPLUS))) for d, t in zip(data, target, strict=True)
            ]
            out.append(BlendOrder(parts, w, sum(target), cache))
        else:  # weighted by each dataset's one-epoch sample count
            parts = [gpt(d, i, None) for d in data]
            lengths = [len(p) for p in parts]
            out.append(BlendOrder(parts, lengths, min(sizes[i], sum(lengths)), cache))
    return out


class MegatronOrderDataset:
    """A split in Megatron's order for megart's trainer: global batch b is samples
    [b * size, (b + 1) * size), its rows arranged so that the trainer's contiguous share of
    data-parallel rank r, cut into micro batches, gives r the micro batches Megatron's
    MegatronPretrainingSampler gives it (micro batch j: samples j*mbs*dp + r*mbs ... + mbs)."""

    def __init__(self, order: Order, seq_length: int, micro_batch_size: int, dp: int) -> None:
        self.order, self.seq_length = order, seq_length
        self.mbs, self.dp = micro_batch_size, dp

    def rows(self, batch: int, size: int) -> np.ndarray:
        """The sample numbers of global batch ``batch``, in the trainer's row order."""
        m = size // (self.mbs * self.dp)
        ids = np.arange(size).reshape(m, self.dp, self.mbs).transpose(1, 0, 2).reshape(-1)
        return batch * size + ids

    def global_batch(
        self, seed: int, iteration: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        del seed  # the order's seed is --seed, fixed when the indices were built
        rows = self.rows(iteration, size)
        if rows[-1] >= len(self.order):
            raise ConfigError(
                f"batch {iteration} needs sample {int(rows.max())} of a split with "
                f"{len(self.order)} samples (Megatron builds as many as --train-iters and "
                "--eval-iters ask for)"
            )
        windows = torch.from_numpy(np.stack([self.order.sample(int(i)) for i in rows]))
        return windows[:, :-1], windows[:, 1:]


def eval_batch(config, done: int, last: bool) -> int:  # noqa: ANN001 (TrainConfig)
    """The first validation batch of the evaluation after ``done`` iterations: Megatron's
    validation iterator goes on from evaluation to evaluation (every --eval-interval, then
    once more after the last iteration: that one is the last evaluation megart reports)."""
    k = config.train_iters // config.eval_interval if last else done // config.eval_interval - 1
    return k * config.eval_iters


def megatron_datasets(config, dp: int) -> tuple:  # noqa: ANN001 (TrainConfig: no cycle)
    """The training, validation and test datasets of --data-path (cut by --split) or of the
    per-split paths, in Megatron-Core's order (None where Megatron builds none or
    --eval-iters is 0)."""
    sizes: list[int | None] = list(num_samples(config))
    if config.eval_iters <= 0:
        sizes[1] = sizes[2] = None
    args = (config.seed, config.seq_length)
    opened: dict[str, IndexedTokens] = {}
    mmap, cache = config.mmap_bin_files, config.data_cache_path
    per_split = (config.train_data_path, config.valid_data_path, config.test_data_path)
    if any(per_split):
        orders: list[Order | None] = []
        for i, path in enumerate(per_split):
            whole = [None, None, None]
            whole[i] = (0.0, 1.0)
            orders.append(
                build_orders(path, whole, sizes, *args, opened, mmap, cache)[i] if path else None
            )
    else:
        bookends = split_bookends(config.split)  # None: Megatron-LM's default
        orders = build_orders(config.data_path, bookends, sizes, *args, opened, mmap, cache)
    for d in opened.values():
        d.check_vocab(config.vocab_size)
    mbs = config.micro_batch_size
    return tuple(
        None if o is None else MegatronOrderDataset(o, config.seq_length, mbs, dp) for o in orders
    )
