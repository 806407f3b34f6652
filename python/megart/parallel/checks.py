"""Does a model split over a layout? Checked before any process group or weight exists, so a
bad combination fails at once with the numbers and what would fit."""

from __future__ import annotations

from megart.errors import ConfigError
from megart.parallel.layout import GridLayout, divisors


def _fitting(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


def check_model_fits(
    layout: GridLayout,
    num_layers: int,
    num_attention_heads: int,
    vocab_size: int | None = None,
    chunks: int = 1,
    num_query_groups: int | None = None,
) -> None:
    """Raises ConfigError listing every way the model does not split over ``layout``:

    - attention heads must divide evenly over the tensor-parallel ranks, and with grouped-query
      attention (``num_query_groups``) so must the groups, which must divide the heads: each
      rank holds whole groups with their key and value heads;
    - layers must divide evenly over pp stages x ``chunks`` model chunks per stage
      (interleaving, which also needs pp > 1).

    The vocabulary is not checked beyond being positive: the model pads it to a multiple of
    128 x tp, as Megatron does, so any size fits.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_attention_heads", num_attention_heads),
        ("chunks", chunks),
        *([("num_query_groups", num_query_groups)] if num_query_groups is not None else []),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise ConfigError(f"vocab_size must be a positive integer, got {vocab_size!r}")

    tp, pp, world = layout.tp, layout.pp, layout.world_size
    problems = []
    if num_attention_heads % tp:
        # tp values that split the heads and still fit the world with this pp.
        fits = [t for t in divisors(num_attention_heads) if world % (t * pp) == 0]
        problems.append(
            f"num_attention_heads={num_attention_heads} is not divisible by tp={tp}; "
            f"tp that fits (with pp={pp}, world_size={world}): {_fitting(fits)}"
        )
    groups = num_query_groups
    if groups is not None and num_attention_heads % groups:
        problems.append(
            f"num_query_groups={groups} does not divide num_attention_heads="
            f"{num_attention_heads}; groups that fit: {_fitting(divisors(num_attention_heads))}"
        )
    elif groups is not None and groups % tp:
        fits = [t for t in divisors(groups) if world % (t * pp) == 0]
        problems.append(
            f"num_query_groups={groups} is not divisible by tp={tp}; "
            f"tp that fits (with pp={pp}, world_size={world}): {_fitting(fits)}"
        )
    if chunks > 1 and pp == 1:
        problems.append(f"chunks={chunks} (interleaving) needs pp > 1, but pp=1")
    elif num_layers % (pp * chunks):
        stages = f"pp={pp}" if chunks == 1 else f"pp={pp} x chunks={chunks} = {pp * chunks}"
        pp_fits = [
            p
            for p in divisors(world // tp)
            if num_layers % (p * chunks) == 0 and (chunks == 1 or p > 1)
        ]
        hint = f"pp that fits (with tp={tp}, chunks={chunks}): {_fitting(pp_fits)}"
        if chunks > 1:
            chunk_fits = divisors(num_layers // pp) if num_layers % pp == 0 else []
            hint += f"; chunks that fit with pp={pp}: {_fitting(chunk_fits)}"
        problems.append(f"num_layers={num_layers} is not divisible by {stages}; {hint}")
    if problems:
        raise ConfigError("the model does not fit the layout: " + "; ".join(problems))
