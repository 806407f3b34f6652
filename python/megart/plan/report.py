"""megart plan's output: the table of candidates, the JSON object and the PNG."""

from __future__ import annotations

import dataclasses
from typing import Any

from megart.plan.estimate import Estimate
from megart.plan.hardware import GIB, GPUProfile
from megart.plan.search import why_slower

PARTS = ("parameters", "gradients", "optimizer", "activations", "autocast_copies", "total")


def memory_gib(e: Estimate) -> dict[str, float]:
    """The parts in GiB, and of the activations what zero-bubble schedules keep between I and
    W for the weight gradients (``weight_grads``)."""
    return {k: e.memory[k] / GIB for k in (*PARTS, "weight_grads")}


def to_dict(e: Estimate, best: Estimate) -> dict[str, Any]:
    # Uneven stages' first/last layers and full recomputation's spans (given, or block N
    # searched) are in "flags" only, so that the layout's keys stay those of every plan.
    given = ("first", "last", "recompute_method", "recompute_num_layers")
    layout = {k: v for k, v in dataclasses.asdict(e.layout).items() if k not in given}
    return {
        "layout": {**layout, "flags": e.layout.flags(e.num_layers)},
        "microbatches": e.microbatches,
        "iteration_time_s": e.iteration_time,
        "time_s": dict(e.time),
        "tflops_per_gpu": e.tflops_per_gpu,
        "model_tflops_per_gpu": e.model_tflops_per_gpu,
        "mfu": e.mfu,
        "bubble_fraction": e.bubble_fraction,
        "pipeline_schedule": e.layout.kind,
        "memory_gib": memory_gib(e),
        "fits": e.fits,
        "missing_gib": e.missing_bytes / GIB,
        "why": why_slower(e, best),
    }


def plan_json(found: list[Estimate], gpu: GPUProfile, world: int) -> dict[str, Any]:
    """The recommended layout's figures at the top level, every candidate under "candidates"."""
    best = found[0]
    return {
        "gpu": gpu.name,
        "num_gpus": world,
        "usable_memory_gib": gpu.usable_bytes / GIB,
        **to_dict(best, best),
        "candidates": [to_dict(e, best) for e in found],
    }


def table(found: list[Estimate], gpu: GPUProfile, world: int) -> str:
    best = found[0]
    head = (
        f"megart plan: {world} x {gpu.name} ({gpu.usable_bytes / GIB:.1f} GiB usable per GPU); "
        f"{len(found)} best layouts, recommended first\n"
    )
    cols = (
        f"{'layout':<42} {'iter s':>8} {'TFLOP/s':>8} {'MFU':>6} {'bubble':>7} "
        f"{'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'16-bit':>7} {'total':>7}  why"
    )
    lines = [head, cols, "-" * len(cols)]
    for e in found:
        g = memory_gib(e)
        lines.append(
            f"{e.layout.short():<42} {e.iteration_time:>8.3f} {e.tflops_per_gpu:>8.1f} "
            f"{100 * e.mfu:>5.1f}% {100 * e.bubble_fraction:>6.1f}% "
            + " ".join(f"{g[k]:>7.1f}" for k in PARTS)
            + f"  {why_slower(e, best)}"
        )
    lines.append("")
    lines.append(
        "memory in GiB per GPU (worst rank; 16-bit: autocast's copies of the weights); TFLOP/s "
        "count recomputed FLOPs, MFU does not"
    )
    lines.append(f"recommended: megart train {best.layout.flags(best.num_layers)}")
    return "\n".join(lines)


def draw(found: list[Estimate], gpu: GPUProfile, path: str) -> None:
    """Iteration time against memory per GPU, the usable memory marked. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        from megart.errors import ConfigError

        raise ConfigError('--png needs matplotlib: pip install "megart[plot]"') from e
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, e in enumerate(found):
        color = "tab:green" if i == 0 else ("tab:blue" if e.fits else "tab:red")
        ax.scatter(e.memory["total"] / GIB, e.iteration_time, color=color)
        ax.annotate(e.layout.short(), (e.memory["total"] / GIB, e.iteration_time), fontsize=6)
    ax.axvline(gpu.usable_bytes / GIB, color="gray", linestyle="--", label="usable memory")
    ax.set_xlabel("memory per GPU (GiB, worst rank)")
    ax.set_ylabel("iteration time (s)")
    ax.set_title(f"megart plan on {gpu.name}: recommended in green")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
