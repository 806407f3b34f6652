"""Timeline pictures in the style of the Megatron-LM papers' schedule figures: a row per rank
(rank 0 on top), forward boxes blue and backward green (split backwards: input gradient I
teal, weight gradient W orange), numbered by microbatch, later model
chunks in lighter shades, idle time (the bubble) hatched grey."""

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
    fig, axes = plt.subplots(
        len(runs),
        1,
        figsize=(width, 0.42 * sum(heights) + 0.9),
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
    legend = [
        Patch(facecolor=_COLOURS["F"], label="forward"),
        Patch(facecolor=_COLOURS["B"], label="backward"),
        Patch(facecolor="#f2f2f2", hatch="///", label="idle (bubble)"),
    ]
    ops = {span.action.op for _, sim in runs for r in sim.ranks for span in r.compute}
    if "I" in ops or "W" in ops:  # split backwards: input and weight gradients apart
        legend[1:2] = [
            *([Patch(facecolor=_COLOURS["B"], label="backward")] if "B" in ops else []),
            Patch(facecolor=_COLOURS["I"], label="input grad (I)"),
            Patch(facecolor=_COLOURS["W"], label="weight grad (W)"),
        ]
    if any(s.chunks > 1 for s, _ in runs):
        legend.insert(2, Patch(facecolor=_shade(_COLOURS["F"], 1, 2), label="later chunks"))
    fig.legend(handles=legend, loc="lower right", ncol=len(legend), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
