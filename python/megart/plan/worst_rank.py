"""The pipeline rank that holds the most memory at its peak, and what each rank holds then."""

from __future__ import annotations

from megart.models import GPTConfig
from megart.plan import activations as act
from megart.plan.holding import Held, peaks
from megart.plan.layout import ZERO_BUBBLE, Layout
from megart.plan.memory import precision, rank_memory
from megart.plan.mtp_memory import mtp_weight_grad_bytes
from megart.plan.pipeline_run import PipelineRun, states_of
from megart.plan.recompute_memory import chunk_layer_bytes
from megart.training.config import TrainConfig


def worst_rank_memory(
    c: TrainConfig,
    cfg: GPTConfig,
    layout: Layout,
    dp: int,
    run: PipelineRun,
    runtime: str,
    unfused_attention: bool,
    gradient_copies: int = 0,
) -> tuple[dict[str, float], list[Held]]:
    """Memory by part of the pipeline rank that holds the most (the first, the second or the
    last: embedding, most in flight, output layer), and each rank's pairs held at its peak.
    Under zero-bubble schedules pairs between I and W keep other tensors than pairs between F
    and I: the rank's compute order says how many of each it holds at its largest."""
    t, p, v, b, sp = layout.sizes()
    prec = precision(c, runtime)
    held = [Held(n) for n in run.in_flight]
    layers = [n // v for n in layout.layer_counts(cfg.num_layers)]  # per chunk, each rank
    if p > 1 and layout.kind in ZERO_BUBBLE:
        assert run.plan is not None
        cp = layout.cp
        pair = act.output_bytes(cfg, b, t, sp, prec, cp) + act.rope_table_bytes(cfg, cp)
        per_pair = [
            chunk_layer_bytes(cfg, b, t, sp, prec, n, unfused_attention, cp)[0] + pair
            for n in layers
        ]
        grads = [act.weight_grad_bytes(cfg, b, t, prec, cp) * n for n in layers]
        out_grads = act.output_weight_grad_bytes(cfg, b, t, prec, cp)
        out_grads += mtp_weight_grad_bytes(cfg, b, t, prec, cp)  # the depths' (plan.mtp_memory)
        last = p * v - 1
        costs = [
            [g + (out_grads if run.plan.virtual_stage(r, k) == last else 0) for k in range(v)]
            for r, g in enumerate(grads)
        ]
        held = peaks(run.plan, per_pair, costs, states_of(layout.kind, p, run.plan.microbatches, v))
    worst: dict[str, float] | None = None
    # Even stages: the first (embedding), the second (most in flight) or the last (output
    # layer) holds the most; uneven ones: any may.
    ranks = range(p) if layout.uneven else sorted({0, min(1, p - 1), p - 1})
    for r in ranks:
        parts = rank_memory(
            c, layout, dp, r, held[r], runtime, unfused_attention, gradient_copies=gradient_copies
        )
        if worst is None or parts["total"] > worst["total"]:
            worst = parts
    assert worst is not None
    return worst, held
