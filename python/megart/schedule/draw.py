"""Timeline pictures in the style of the Megatron-LM papers' schedule figures: a row per rank
(rank 0 on top), forward boxes blue and backward green (split backwards: input gradient I
teal, weight gradient W orange), numbered by microbatch, later model chunks in lighter shades
(each shade drawn has its legend entry), idle time (the bubble) hatched grey."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megart._core import schedule as _s
from megart.errors import ConfigError

# One hue per compute op; chunk c is blended toward white by c / (v + 1).
_COLOURS = {
    "F": (0.16, 0.38, 0.78),
    "B": (0.13, 0.60, 0.33),
    "I": (0.20, 0.68, 0.62),
    "W": (0.86, 0.55, 0.13),
}


def _shade(rgb: tuple[float, float, float], chunk: int, chunks: int) -> tuple[float, ...]:
    t = chunk / (chunks + 1)
    return tuple(c + (1 - c) * t for c in rgb)


_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}


def legend_entries(
    runs: Sequence[tuple[_s.Schedule, _s.Simulation]],
) -> list[tuple[str, tuple[float, ...]]]:
    """(label, colour) of every shade the panels use, in op then chunk order: one entry per
    (op, chunk) drawn, so each later chunk's forward and backward shade is explained."""
    used: dict[tuple[str, int], tuple[float, ...]] = {}
    chunked = any(s.chunks > 1 for s, _ in runs)
    for s, sim in runs:
        for timeline in sim.ranks:
            for span in timeline.compute:
                a = span.action
                used.setdefault((a.op, a.chunk), _shade(_COLOURS[a.op], a.chunk, s.chunks))
    order = list(_COLOURS)
    return [
        (_NAMES[op] + (f", chunk {chunk}" if chunked else ""), colour)
        for (op, chunk), colour in sorted(
            used.items(), key=lambda x: (order.index(x[0][0]), x[0][1])
        )
    ]


def _pyplot():  # noqa: ANN202 (matplotlib is optional)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("drawing a schedule needs matplotlib: pip install 'megart[plot]'") from e
    return plt


def draw(
    runs: Sequence[tuple[_s.Schedule, _s.Simulation]] | tuple[_s.Schedule, _s.Simulation],
    path: str | Path,
    title: str | None = None,
) -> Path:
    """Draws one panel per (schedule, simulation) into a PNG at ``path``; returns the path.
    Panels share the time axis, so schedules of one model compare at a glance."""
    if isinstance(runs, tuple) and len(runs) == 2 and isinstance(runs[0], _s.Schedule):
        runs = [runs]
    runs = list(runs)
    if not runs:
        raise ConfigError("draw() needs at least one (schedule, simulation) pair")
    plt = _pyplot()
    from matplotlib.patches import Patch, Rectangle

    horizon = max(sim.makespan for _, sim in runs)
    heights = [s.stages + 1.2 for s, _ in runs]
    width = min(28.0, 4 + 0.35 * max(len(s.ranks[0]) for s, _ in runs))
    # Rows grow with the width, so a wide picture shrunk to a screen's width keeps rows (and
    # their microbatch numbers) readable: at most 40 row heights across.
    row = max(0.42, width / 40)
    fig, axes = plt.subplots(
        len(runs),
        1,
        figsize=(width, row * sum(heights) + 1.2),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
        sharex=True,
    )
    for ax, (s, sim) in zip(axes[:, 0], runs, strict=True):
        for rank, timeline in enumerate(sim.ranks):
            y = s.stages - 1 - rank
            ax.add_patch(
                Rectangle(
                    (0, y + 0.08),
                    sim.makespan,
                    0.84,
                    facecolor="#f2f2f2",
                    edgecolor="none",
                    hatch="///",
                    zorder=0,
                )
            )
            for span in timeline.compute:
                a = span.action
                colour = _shade(_COLOURS[a.op], a.chunk, s.chunks)
                ax.add_patch(
                    Rectangle(
                        (span.start, y + 0.08),
                        span.end - span.start,
                        0.84,
                        facecolor=colour,
                        edgecolor="white",
                        linewidth=0.8,
                        zorder=1,
                    )
                )
                if span.end - span.start >= horizon / 250:
                    ax.text(
                        (span.start + span.end) / 2,
                        y + 0.5,
                        str(a.mb),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                        zorder=2,
                    )
        ax.set_ylim(-0.1, s.stages + 0.1)
        ax.set_yticks([s.stages - 1 - r + 0.5 for r in range(s.stages)])
        ax.set_yticklabels([f"rank {r}" for r in range(s.stages)])
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(
            f"{s.kind}: p={s.stages}, m={s.microbatches}, v={s.chunks}; "
            f"bubble {sim.bubble_fraction:.3f}, makespan {sim.makespan:.2f}",
            fontsize=9,
            loc="left",
        )
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1, 0].set_xlabel("time")
    legend = [Patch(facecolor=colour, label=label) for label, colour in legend_entries(runs)]
    legend.append(Patch(facecolor="#f2f2f2", hatch="///", label="idle (bubble)"))
    columns = min(len(legend), 6)
    fig.legend(handles=legend, loc="lower right", ncol=columns, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    legend_rows = -(-len(legend) // columns)
    fig.tight_layout(rect=(0, min(0.3, 0.3 * legend_rows / (row * sum(heights) + 1.2)), 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
