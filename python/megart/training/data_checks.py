"""The checks of a training configuration's data flags: its sources (--data-path with --split,
or a dataset per split), what --data-order megatron covers, --split's weights, and Megatron's
--full-validation (refused). Each error names the flags and says what to give."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.errors import ConfigError
from megart.training.pad_tokens import check_pad_flags

if TYPE_CHECKING:
    from megart.training.config import TrainConfig

DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's --split when --data-path is given without it


def check_data_sources(cfg: TrainConfig) -> None:
    """Megatron-LM's data sources, one at a time: --mock-data, --data-path (cut by --split),
    or the per-split paths, of which training needs --train-data-path."""
    per_split = [
        f"--{s}-data-path" for s in ("train", "valid", "test") if getattr(cfg, f"{s}_data_path")
    ]
    if not per_split:
        return
    named = " and ".join(per_split)
    other = "--data-path" if cfg.data_path else "--mock-data" if cfg.mock_data else None
    if other:
        raise ConfigError(
            f"{other} and {named} exclude each other (as in Megatron-LM, one data source): give "
            "--data-path with --split, or a dataset per split"
        )
    if cfg.split is not None:
        raise ConfigError(
            f"--split {cfg.split} with {named}: --split cuts --data-path, and each split has "
            "its own dataset here (Megatron-LM ignores it; megart refuses rather than ignore "
            "it); leave --split out"
        )
    if not cfg.train_data_path:
        raise ConfigError(
            f"{named} without --train-data-path: training reads --train-data-path's dataset; "
            "add it (or give --data-path with --split)"
        )


def check_megatron_order(config: TrainConfig) -> None:
    """--data-order megatron covers Megatron's indexed datasets at a constant batch; what it
    does not cover is refused by name."""
    check_pad_flags(config)
    if config.data_order != "megatron":
        return
    per_split = (config.train_data_path, config.valid_data_path, config.test_data_path)
    refused = [
        (config.mock_data, "--mock-data (Megatron's mock dataset is not reproduced)"),
        (not config.data_path and not any(per_split), "the built-in corpus (no --data-path)"),
        (config.train_samples is not None, "--train-samples (give --train-iters)"),
        (config.rampup_batch_size, "--rampup-batch-size (a constant --global-batch-size only)"),
    ]
    for bad, what in refused:
        if bad:
            raise ConfigError(
                f"--data-order megatron does not cover {what}; use --data-order megart or "
                "drop the flag"
            )


def refuse_full_validation(cfg: TrainConfig) -> None:
    """Megatron-LM's --full-validation: refused. Megatron-LM of megatron-core 0.16's time
    (its default --dataloader-type single) sets --eval-iters to the validation sampler's
    length, which is the set's sample count rather than its batch count, and reads a single
    set through an iterator that does not cycle, so its evaluation stops (StopIteration) once
    the set is read; its main branch has since redefined the flag (one sample per rank and
    micro batch, a cycling iterator, --eval-iters the largest rank's count)."""
    if cfg.full_validation:
        raise ConfigError(
            "--full-validation is not reproduced: its meaning changes between Megatron-LM "
            "versions (the one of megatron-core 0.16 stops its evaluation with StopIteration "
            "once the validation set is read); give --eval-iters N, the validation batches of "
            "each evaluation (with --data-order megatron they go on from evaluation to "
            "evaluation, as Megatron's)"
        )


def split_weights(split: str | None) -> tuple[float, float, float]:
    """--split "969,30,1" (or "90,10"; missing weights are 0) as fractions of the corpus; None
    (not given) is Megatron-LM's legacy default, DEFAULT_SPLIT."""
    split = DEFAULT_SPLIT if split is None else split
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or weights[0] <= 0:
        raise ConfigError(
            f"--split {split!r}: give up to three non-negative weights for train, validation "
            "and test, with a positive train weight, e.g. --split 969,30,1"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total
