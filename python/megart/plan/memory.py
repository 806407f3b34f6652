"""Memory of one pipeline rank at its peak, by part: the parameters, gradients and optimizer
state it owns and the activations its schedule holds."""

from __future__ import annotations

import functools

from megart.plan import activations as act
from megart.plan import documents as docs
from megart.plan import window_memory as windows
from megart.plan.holding import Held
from megart.plan.layout import Layout
from megart.plan.moe_memory import MoeRank
from megart.plan.mtp_memory import mtp_stage_bytes, mtp_weight_grad_bytes
from megart.plan.parameters import FP32, expert_elements, state_bytes
from megart.plan.recompute_memory import dropped_norms_rise, full_recompute_bytes
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


@functools.lru_cache(maxsize=256)
def _first_stage_pairs(kind: str, p: int, m: int, v: int, pairs: int) -> int:
    """Of ``pairs`` held on rank 0, those of its first chunk (virtual stage 0, the embedding's;
    zb-v's too): every pair with one chunk, else the most of any moment holding ``pairs``
    under the schedule (window_memory.held_by_chunk)."""
    if v == 1:
        return pairs
    return windows.held_by_chunk(kind, p, m, v, 0, pairs, (1.0,) + (0.0,) * (v - 1))[0]


def rank_memory(
    c: TrainConfig,
    layout: Layout,
    dp: int,
    pp_rank: int,
    held: Held | int,
    runtime: str = "megart",
    unfused_attention: bool = False,
    dp_rank: int | None = None,
    gradient_copies: int = 0,
    expert_tokens: float = 1.0,
) -> dict[str, float]:
    """Bytes pipeline rank ``pp_rank`` (data-parallel rank ``dp_rank``, None: the worst) holds
    at its peak, by part, with ``held`` (microbatch, chunk) pairs in flight (a count: all
    between forward and backward). "activations" is what autograd saves ("saved", what
    saved-tensor hooks see) plus the chunk outputs megart's pipeline engine keeps ("outputs"),
    with full recomputation what a pair's backward holds above its kept bytes while it
    recomputes a span of layers (recompute_memory: "recompute_working"), and with
    zero-bubble schedules what pairs between I and W keep for their weight gradients
    ("weight_grads").

    With context parallelism (``layout.cp``) the activations are those of the rank's s/cp
    tokens plus what its attention gathers, and gradients and the distributed optimizer are
    shared by the ``dp`` x cp ranks that average them: ``dp_rank`` is then the rank's index
    in that group (Megatron's data-parallel group with context parallelism, cp innermost).

    ``gradient_copies``: bytes per gradient element held beside the fp32 gradients counted
    (runtime_options.gradient_copy_bytes: SC21's Megatron-LM's 16-bit gradients).

    Under expert parallelism (``layout.ep`` > 1) the rank holds E/ep of each MoE layer's
    experts, and its experts' saves are for the token copies the all-to-all brings them:
    ``expert_tokens`` times k T a microbatch (1: balanced routing, what the planner assumes;
    plan.moe_memory)."""
    if isinstance(held, int):
        held = Held(held)
    cfg = c.gpt_config()
    megatron = runtime == "megatron"
    t, p, v, b, sp = layout.sizes()
    rec = cfg.recompute_granularity
    prec = precision(c, runtime)
    cp = layout.cp
    per_chunk_layers = layout.layer_counts(cfg.num_layers)[pp_rank] // v  # uneven: its own
    n = held.activations
    if megatron:  # Korthikanti et al.'s counts, spans as Megatron-LM's (and megart's) run
        one = act.megatron_layer_bytes(cfg, b, t, sp, rec, unfused_attention)
        kept, risen = per_chunk_layers * one, 0.0
        if rec == "full":
            whole = act.megatron_layer_bytes(cfg, b, t, sp, None, unfused_attention)
            method, span = cfg.recompute_method, cfg.recompute_num_layers
            kept, risen = full_recompute_bytes(per_chunk_layers, method, span, one, whole)
        saved = n * kept
    else:  # each chunk's layers with their sliding windows (plan.window_memory)
        saved, risen, cached = windows.rank_layer_bytes(
            c, cfg, layout, dp, pp_rank, n, prec, unfused_attention, expert_tokens
        )
        saved += cached  # the window's bias and mask, once a rank
        saved += n * act.rope_table_bytes(cfg, cp)  # rope's cos and sin, shared by its layers
        # The document flags' (plan.documents): the documents' mask, per pair and once.
        per_pair, once = docs.mask_bytes(c, b, prec)
        saved += n * (per_pair + docs.positions_bytes(c, b, cp, pp_rank == 0)) + once
    if pp_rank == 0:  # the embedding's saves, kept by the pairs of the first virtual stage
        first_pairs = _first_stage_pairs(layout.kind, p, c.microbatches(dp), v, n)
        saved += first_pairs * act.first_stage_bytes(cfg, b, t, cp, sp)
    loss = 0.0
    if pp_rank == (0 if layout.kind == "zb-v" else p - 1):  # zb-v's last stage is on rank 0
        loss = act.last_stage_bytes(cfg, b, t, sp, prec, cp)
        saved += loss + (0.0 if megatron else docs.loss_mask_bytes(c, b, cp))
        # Multi-token prediction's depths, run with the loss (plan.mtp_memory).
        weights = 2 if c.half_weights and (c.bf16 or c.fp16) else 4
        depth_rank = MoeRank(prec, cp, weights, t, sp, layout.ep, expert_tokens)
        depths, depth_rise = mtp_stage_bytes(cfg, b, t, sp, prec, depth_rank)
        saved, risen = saved + depths, max(risen, depth_rise)
    # --recompute-modules layernorm: a norm's output saved until read, or made again with its
    # own saves, at one layer; on the loss's rank the loss's saves are gone by the latter.
    saved += max(0.0, dropped_norms_rise(cfg, b, t, sp, prec, cp) - loss)
    outputs = 0.0
    if (pp_rank < p - 1 or v > 1) and not megatron:
        outputs = n * act.output_bytes(cfg, b, t, sp, prec, cp)
    # The rank's most pairs are held when a backward starts (the count only falls by one),
    # that pair's saves included until it replays its spans. On the last stage the loss's
    # saves are freed by then (its backward runs first), but that backward makes the logits'
    # gradient, as large as the fp32 softmax it keeps, which no part counts: the loss's saves,
    # counted beside the replay, stand for it.
    working = risen
    grads = held.weight_grads * per_chunk_layers * act.weight_grad_bytes(cfg, b, t, prec, cp)
    out_grads = act.output_weight_grad_bytes(cfg, b, t, prec, cp)
    out_grads += mtp_weight_grad_bytes(cfg, b, t, prec, cp)  # the depths' (plan.mtp_memory)
    grads += held.last_stage_weight_grads * out_grads
    # 16-bit weights with fp32 main weights need no autocast copies (megart's --half-weights
    # counted exactly as megart holds them, Megatron-LM's by its convention below); fp32
    # weights under autocast need a 16-bit copy of each.
    half = sixteen_bit_weights(c, runtime) and not megatron
    # megart's data-parallel flags as megart.training.optimizer builds the buckets from them;
    # Megatron-LM's runtime is counted by its own convention (fp32 gradients, its buckets).
    ddp = () if megatron else (c.ddp_bucket_size, c.ddp_num_buckets, c.grad_reduce_in_bf16)
    state = state_bytes(
        cfg, t, p, pp_rank, v, dp * cp, layout.distributed_optimizer, dp_rank,
        layout.kind == "zb-v", half, layout.first, layout.last, *ddp, ep=layout.ep,
    )  # fmt: skip
    params = state.parameters // FP32
    if c.moe_grouped_gemm and cfg.num_experts:  # no autocast copies of grouped experts
        where = (cfg, t, p, pp_rank, v, layout.kind == "zb-v", layout.first, layout.last)
        params -= expert_elements(*where, ep=layout.ep)
    autocast = params * prec.other if prec.other < 4 and not (half or megatron) else 0
    optimizer = float(state.optimizer)
    if megatron:  # + fp32 main weights: 12 bytes per stepped element instead of 8
        optimizer = float(state.optimizer) * 3 / 2
    copies = float(state.gradients) / FP32 * gradient_copies
    parts = {
        "parameters": float(state.parameters) / (2 if megatron else 1),
        "gradients": float(state.gradients + state.reduce_copies) + copies,
        "optimizer": optimizer,
        "activations": saved + outputs + working + grads,
        "autocast_copies": float(autocast),
    }
    parts["total"] = sum(parts.values())
    parts.update(saved=saved, outputs=outputs, recompute_working=working, weight_grads=grads)
    # The fp32 gradient buffers alone (what is reduced, in fp32 elements), their bf16 copies,
    # and the elements per bucket --ddp-bucket-size/--ddp-num-buckets gave (0: a bucket per
    # tensor; absent: megart's own 4 MiB).
    parts.update(gradient_buffers=float(state.gradients), reduce_copies=float(state.reduce_copies))
    # Of those, the experts' under expert parallelism (reduced over expert-data parallelism).
    parts["expert_gradient_buffers"] = float(state.expert_gradients)
    if state.bucket_elements is not None:
        parts["bucket_elements"] = float(state.bucket_elements)
    return parts
