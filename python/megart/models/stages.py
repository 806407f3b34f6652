"""Which layers each pipeline stage holds, with Megatron-LM's uneven first and last stages
(``--decoder-first-pipeline-num-layers F``, ``--decoder-last-pipeline-num-layers L``).

Without them every pipeline rank holds num_layers / p layers. With them the first (last) rank
holds F (L) layers and the layers left spread evenly over the other ("middle") ranks. Each rank's
layers split evenly over its v model chunks (interleaving): chunk c of rank r is virtual stage
c p + r, and virtual stages hold consecutive layers in that order, so chunk c of rank r starts
at c (num_layers / v) plus the layers of the chunks of ranks 0..r-1 (Megatron-Core's
``get_transformer_layer_offset`` and ``get_num_layers_to_build`` place them the same way; the
tests compare the two). ``check_stages`` refuses what Megatron-Core's TransformerConfig refuses.
"""

from __future__ import annotations

from megart.errors import ConfigError
from megart.parallel.layout import either

FIRST = "--decoder-first-pipeline-num-layers"
LAST = "--decoder-last-pipeline-num-layers"


def rank_layer_counts(
    num_layers: int, pp: int, first: int | None = None, last: int | None = None
) -> list[int]:
    """The number of layers of each pipeline rank (not checked: see check_stages)."""
    ends = [n for n in (first, last) if n is not None]
    middle_ranks = pp - len(ends)
    per = (num_layers - sum(ends)) // middle_ranks if middle_ranks > 0 else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_ranges(
    num_layers: int,
    pp_rank: int,
    pp: int,
    chunks: int = 1,
    first: int | None = None,
    last: int | None = None,
) -> list[range]:
    """The layers of each model chunk (virtual stage c pp + pp_rank) of pipeline rank pp_rank."""
    per_chunk = [n // chunks for n in rank_layer_counts(num_layers, pp, first, last)]
    lap = sum(per_chunk)  # the layers of one chunk of every rank
    starts = [c * lap + sum(per_chunk[:pp_rank]) for c in range(chunks)]
    return [range(s, s + per_chunk[pp_rank]) for s in starts]


def ends_of(counts: list[int]) -> tuple[int | None, int | None]:
    """The (first, last) flags that give pipeline ranks ``counts`` layers (rank_layer_counts'
    inverse; (None, None) for an even split); at pp 2 the first alone."""
    if len(set(counts)) <= 1:
        return None, None
    if len(counts) == 2:
        return counts[0], None
    middle = counts[1]
    return (
        counts[0] if counts[0] != middle else None,
        counts[-1] if counts[-1] != middle else None,
    )


def uneven(first: int | None, last: int | None) -> bool:
    return first is not None or last is not None


def check_stages(
    num_layers: int, pp: int, chunks: int = 1, first: int | None = None, last: int | None = None
) -> None:
    """Refuses uneven stages that do not fit, naming the flags and what would (Megatron-Core's
    rules: values above 0 and divisible by the chunks per rank, the layers left a multiple of
    the middle ranks and of their chunks, no middle layers without middle ranks)."""
    if not uneven(first, last):
        return
    given = " and ".join(
        f"{flag} {n}" for flag, n in ((FIRST, first), (LAST, last)) if n is not None
    )
    if pp < 2:
        raise ConfigError(
            f"{given} set the layers of the first/last of several pipeline stages: use "
            "--pipeline-model-parallel-size of at least 2, or leave them out"
        )
    for flag, n in ((FIRST, first), (LAST, last)):
        if n is None:
            continue
        if n < 1:
            raise ConfigError(f"{flag} {n} must be at least 1 (or left out)")
        if n % chunks:
            raise ConfigError(
                f"{flag} {n} must be divisible by the {chunks} model chunks (virtual stages) "
                f"of each pipeline rank; use a multiple of {chunks}"
            )
    middle_ranks = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    if middle_ranks == 0:
        if chunks > 1:  # Megatron-Core's layer offset divides by the middle stages there
            raise ConfigError(
                f"{given} with {pp} pipeline stages and {chunks} model chunks per rank leave "
                "no middle stage, which Megatron-Core cannot place with interleaving: leave "
                "one of them out, or interleaving"
            )
        if middle != 0:
            raise ConfigError(
                f"{given}: with {pp} pipeline stages both are given, so they must add up to "
                f"--num-layers {num_layers} (they add up to {num_layers - middle})"
            )
        return
    unit = middle_ranks * chunks  # the middle layers must fill these chunks evenly
    if middle < unit or middle % unit:
        need = "" if chunks == 1 else f" x {chunks} model chunks per rank"
        verb = "leave" if first is not None and last is not None else "leaves"
        raise ConfigError(
            f"{given} {verb} {middle} of --num-layers {num_layers} layers for the other "
            f"{middle_ranks} pipeline stage(s), which hold them evenly: {middle} is not a "
            f"positive multiple of {middle_ranks} stage(s){need} = {unit}; "
            f"{_fitting(num_layers, unit, chunks, first, last)}"
        )


def _fitting(num_layers: int, unit: int, chunks: int, first: int | None, last: int | None) -> str:
    """What check_stages suggests: for each flag given, the two values nearest to it (the other
    kept) that leave the other stages a positive multiple of ``unit`` layers."""
    options = []
    for flag, n, other in ((FIRST, first, last), (LAST, last, first)):
        if n is None:
            continue
        fits = [
            v
            for v in range(chunks, num_layers, chunks)
            if (rest := num_layers - v - (other or 0)) >= unit and rest % unit == 0
        ]
        nearest = sorted(sorted(fits, key=lambda v: abs(v - n))[:2])
        if nearest:
            options.append(f"{flag} {either(nearest)}")
    if not options:
        return "change --num-layers or --pipeline-model-parallel-size"
    return "use " + ", or ".join(options)


def chunk_layers(
    num_layers: int,
    pp_rank: int,
    pp: int,
    chunks: int = 1,
    v_shape: bool = False,
    first: int | None = None,
    last: int | None = None,
) -> list[range]:
    """The layers of each model chunk of pipeline rank ``pp_rank``: chunk c is virtual stage
    vs = c * pp + pp_rank and holds layers [vs * n, (vs + 1) * n), n = layers / (pp * chunks),
    or, with uneven first/last stages (``first``/``last`` layers, see megart.models.stages),
    Megatron-Core's placement of them. ``v_shape`` (the zb-v schedule, two chunks): chunk 0 is
    stage pp_rank, chunk 1 stage 2 pp - 1 - pp_rank (even stages only)."""
    if uneven(first, last):
        if v_shape:
            raise ConfigError(
                "--pipeline-schedule zb-v places two equal chunks per rank in a V and cannot "
                f"take {FIRST} or {LAST}; use 1f1b, zb-h1 or interleaved, or even stages"
            )
        return stage_ranges(num_layers, pp_rank, pp, chunks, first, last)
    n = num_layers // (pp * chunks)
    stages = (
        [pp_rank, 2 * pp - 1 - pp_rank] if v_shape else [c * pp + pp_rank for c in range(chunks)]
    )
    return [range(vs * n, (vs + 1) * n) for vs in stages]
