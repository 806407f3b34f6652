"""Memory of one pipeline rank at its peak, by part: the parameters, gradients and optimizer
state it owns and the activations its schedule holds."""

from __future__ import annotations

from megart.models.recompute import recomputed_spans
from megart.plan import activations as act
from megart.plan.holding import Held
from megart.plan.layout import Layout
from megart.plan.parameters import FP32, state_bytes
from megart.training.config import TrainConfig


def precision(c: TrainConfig, runtime: str) -> act.Precision:
    """Bytes of saved activations: megart's under autocast are 16-bit, its residual stream
    fp32 with --fp32-residual-connection; Megatron-LM runs in 16 bits throughout."""
    if runtime == "megatron":
        return act.Precision(2, 2)
    return act.precision_of(c.bf16, c.fp16, c.fp32_residual_connection)


def sixteen_bit_weights(c: TrainConfig, runtime: str) -> bool:
    """Whether the weights are 16-bit, with fp32 main weights in the optimizer: Megatron-LM's
    always (the published tables' runs), megart's with --half-weights under --bf16/--fp16."""
    return runtime == "megatron" or (c.half_weights and (c.bf16 or c.fp16))


def rank_memory(
    c: TrainConfig,
    layout: Layout,
    dp: int,
    pp_rank: int,
    held: Held | int,
    runtime: str = "megart",
    unfused_attention: bool = False,
    dp_rank: int | None = None,
) -> dict[str, float]:
    """Bytes pipeline rank ``pp_rank`` (data-parallel rank ``dp_rank``, None: the worst) holds
    at its peak, by part, with ``held`` (microbatch, chunk) pairs in flight (a count: all
    between forward and backward). "activations" is what autograd saves ("saved", what
    saved-tensor hooks see) plus the chunk outputs megart's pipeline engine keeps ("outputs"),
    with full recomputation one layer's whole set while it is recomputed
    ("recompute_working"), and with zero-bubble schedules what pairs between I and W keep for
    their weight gradients ("weight_grads").

    With context parallelism (``layout.cp``) the activations are those of the rank's s/cp
    tokens plus what its attention gathers, and gradients and the distributed optimizer are
    shared by the ``dp`` x cp ranks that average them: ``dp_rank`` is then the rank's index
    in that group (Megatron's data-parallel group with context parallelism, cp innermost)."""
    if isinstance(held, int):
        held = Held(held)
    cfg = c.gpt_config()
    megatron = runtime == "megatron"
    t, p, v, b, sp = layout.sizes()
    rec = cfg.recompute_granularity
    prec = precision(c, runtime)
    cp = layout.cp
    per_chunk_layers = layout.layer_counts(cfg.num_layers)[pp_rank] // v  # uneven: its own
    if megatron:
        layer_bytes = act.megatron_layer_bytes(cfg, b, t, sp, rec, unfused_attention)
        full = act.megatron_layer_bytes(cfg, b, t, sp, None, unfused_attention)
    else:
        layer_bytes = act.layer_bytes(cfg, b, t, sp, rec, prec, unfused_attention, cp)
        full = act.layer_bytes(cfg, b, t, sp, None, prec, unfused_attention, cp)
    n = held.activations
    saved = n * per_chunk_layers * layer_bytes
    working_layers = 1  # layers whose whole set one recomputation makes live at once
    if rec == "full" and not megatron:
        # --recompute-method/--recompute-num-layers: each recomputed span keeps its input only,
        # the layers outside them (block) keep everything, as megart.models.gpt runs a chunk.
        spans = recomputed_spans(per_chunk_layers, cfg.recompute_method, cfg.recompute_num_layers)
        kept = sum(stop - start for start, stop, again in spans if not again)
        replayed = [stop - start for start, stop, again in spans if again]
        saved = n * (len(replayed) * layer_bytes + kept * full)
        working_layers = max(replayed)
        if kept:  # the kept layers' rope tables, as without recomputation
            saved += n * act.rope_table_bytes(cfg, None, cp)
    elif not megatron:  # rope's cos and sin, shared by a chunk's layers
        saved += n * act.rope_table_bytes(cfg, rec, cp)
    if pp_rank == 0:
        saved += n * act.first_stage_bytes(cfg, b, t, cp, sp)
    if pp_rank == (0 if layout.kind == "zb-v" else p - 1):  # zb-v's last stage is on rank 0
        saved += act.last_stage_bytes(cfg, b, t, sp, prec, cp)
    outputs = 0.0
    if (pp_rank < p - 1 or v > 1) and not megatron:
        outputs = n * act.output_bytes(cfg, b, t, sp, prec, cp)
    working = working_layers * full + act.rope_table_bytes(cfg, None, cp) if rec == "full" else 0.0
    grads = held.weight_grads * per_chunk_layers * act.weight_grad_bytes(cfg, b, t, prec, cp)
    grads += held.last_stage_weight_grads * act.output_weight_grad_bytes(cfg, b, t, prec, cp)
    # 16-bit weights with fp32 main weights need no autocast copies (megart's --half-weights
    # counted exactly as megart holds them, Megatron-LM's by its convention below); fp32
    # weights under autocast need a 16-bit copy of each.
    half = sixteen_bit_weights(c, runtime) and not megatron
    # megart's data-parallel flags as megart.training.optimizer builds the buckets from them;
    # Megatron-LM's runtime is counted by its own convention (fp32 gradients, its buckets).
    ddp = () if megatron else (c.ddp_bucket_size, c.ddp_num_buckets, c.grad_reduce_in_bf16)
    state = state_bytes(
        cfg, t, p, pp_rank, v, dp * cp, layout.distributed_optimizer, dp_rank,
        layout.kind == "zb-v", half, layout.first, layout.last, *ddp,
    )  # fmt: skip
    params = state.parameters // FP32
    autocast = params * prec.other if prec.other < 4 and not (half or megatron) else 0
    optimizer = float(state.optimizer)
    if megatron:  # + fp32 main weights: 12 bytes per stepped element instead of 8
        optimizer = float(state.optimizer) * 3 / 2
    parts = {
        "parameters": float(state.parameters) / (2 if megatron else 1),
        "gradients": float(state.gradients + state.reduce_copies),
        "optimizer": optimizer,
        "activations": saved + outputs + working + grads,
        "autocast_copies": float(autocast),
    }
    parts["total"] = sum(parts.values())
    parts.update(saved=saved, outputs=outputs, recompute_working=working, weight_grads=grads)
    # The fp32 gradient buffers alone (what is reduced, in fp32 elements) and their bf16 copies.
    parts.update(gradient_buffers=float(state.gradients), reduce_copies=float(state.reduce_copies))
    return parts
