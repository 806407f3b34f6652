"""The layout flags a user gave megart plan (the others are searched), and the pipeline
schedules they leave to try on p stages."""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHUNKS = 8


@dataclass(frozen=True)
class Fixed:
    """The layout flags the user gave (None: search it)."""

    tp: int | None = None
    pp: int | None = None
    chunks: int | None = None
    micro_batch: int | None = None
    sequence_parallel: bool | None = None
    recompute: str | None | bool = False  # False: search; None: no recomputation
    distributed_optimizer: bool | None = None
    schedule: str | None = None  # --pipeline-schedule (None: search it)
    first: int | None = None  # --decoder-first-pipeline-num-layers (uneven stages; not searched)
    last: int | None = None  # --decoder-last-pipeline-num-layers
    cp: int | None = None  # --context-parallel-size (None: search it)
    ep: int | None = None  # --expert-model-parallel-size (None: search it, MoE models only)
    # --recompute-method or --recompute-num-layers given: full recomputation runs the base
    # config's spans, even megart train's defaults (uniform 1) spelt out. False: block N is
    # searched where the base's are those defaults (block_spans.searches_spans).
    spans: bool = False
    # --num-virtual-stages-per-pipeline-rank given: the layouts' flags spell interleaving so
    # (megart train refuses both spellings together).
    chunks_by_count: bool = False


def schedules(fixed: Fixed, p: int, num_layers: int, zero_bubble: bool) -> list[tuple]:
    """(chunks, schedule) pairs to try on p stages: 1F1B and each interleaving that divides
    the layers, and (``zero_bubble``: the runtime has them) zb-h1 and zb-v; those the user
    named only. A schedule of None is megart train's default for its chunks."""
    if p == 1:  # one stage: megart train interleaves nothing, and zb-v folds its layers in two
        if fixed.schedule == "interleaved" and not fixed.chunks:
            return []
        if fixed.schedule == "zb-v":
            return [(2, "zb-v")] if num_layers % 2 == 0 else []
        return [(fixed.chunks or 1, None)]
    if fixed.chunks:  # --num-layers-per-virtual-pipeline-stage: interleaved
        return [(fixed.chunks, None)]
    uneven = fixed.first is not None or fixed.last is not None
    # Uneven stages: megart train's checks refuse the chunks that do not divide them.
    inter = [(v, None) for v in range(2, MAX_CHUNKS + 1) if uneven or num_layers % (p * v) == 0]
    even_zb_v = num_layers % (2 * p) == 0 and (not uneven or fixed.schedule == "zb-v")
    zb = [(1, "zb-h1")] + ([(2, "zb-v")] if even_zb_v else [])
    by_name = {"1f1b": [(1, None)], "interleaved": inter, "zb-h1": zb[:1], "zb-v": zb[1:]}
    if fixed.schedule is not None:
        return by_name[fixed.schedule]
    return [(1, None)] + inter + (zb if zero_bubble else [])
