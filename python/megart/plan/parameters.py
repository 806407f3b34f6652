"""The parameter tensors a megart rank holds, and the gradient buckets and optimizer state they
make, computed from the model's shape alone (no torch): megart's own layout rules, so that the
bytes predicted here are the bytes a ``megart train`` rank holds (tested against real ranks).

By default everything is fp32 in megart: with --bf16/--fp16 the weights stay fp32 (they are the
optimizer's main weights) and autocast computes in 16 bits. With --half-weights the weights are
16-bit and the optimizer holds fp32 main weights of what it steps (megart.training.main_weights).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megart.models.config import GPTConfig
from megart.models.stages import chunk_layers
from megart.plan.mla_memory import mla_tensors
from megart.training.grad_sync import megatron_bucket_size

FP32 = 4
BUCKET_BYTES = 4 << 20  # megart.training.grad_sync.GradientBuckets' default


def _norm(cfg: GPTConfig, size: int | None = None) -> list[int]:
    """A norm's tensors: RMSNorm's weight; LayerNorm's weight and bias (--disable-bias-linear
    or not, as Megatron-Core's)."""
    h = size or cfg.hidden_size
    return [h] if cfg.normalization == "rmsnorm" else [h, h]


def layer_tensors(cfg: GPTConfig, tp: int, layer: int = 0, ep: int = 1) -> list[int]:
    """Element counts of layer ``layer``'s parameters on one tensor-parallel rank, in megart's
    registration order (norm, --softmax-type learnable's sink logits, fused q/k/v, output
    projection, --qk-layernorm's query and key norms, norm, MLP; an MoE layer's router [E, h],
    replicated, and then each expert's MLP of
    moe_ffn_size split over t as the dense MLP, without biases: models.moe; under expert
    parallelism over ``ep`` ranks, E/ep of the experts; then the shared experts' MLP of
    --moe-shared-expert-intermediate-size, split over t as the dense MLP, whole under expert
    parallelism, and their gate's [1, h] weight, replicated)."""
    h, f, t = cfg.hidden_size, cfg.ffn_size, tp
    if cfg.multi_latent_attention:  # its projections and latent norms (plan.mla_memory)
        out = [*_norm(cfg), *mla_tensors(cfg, t)]
    else:
        qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * cfg.head_dim // t
        # --softmax-type learnable's sink logits, the rank's heads: the attention's own
        # parameter, registered before its layers' (models.sinks)
        sink = [cfg.num_attention_heads // t] if cfg.softmax_type == "learnable" else []
        out = [
            *_norm(cfg),
            *sink,
            qkv * h,
            *([qkv] if cfg.qkv_bias else []),
            h * cfg.query_size // t,
        ]
        out += [h] if cfg.bias else []
        if cfg.qk_layernorm:  # replicated on every tensor-parallel rank, one head wide
            out += _norm(cfg, cfg.head_dim) * 2
    out += _norm(cfg)
    if cfg.is_moe_layer(layer):  # the router replicated, each expert split as a dense MLP
        fm = cfg.moe_ffn_size // t
        expert = [fm * h] * (2 if cfg.activation == "swiglu" else 1) + [h * fm]
        out += [cfg.num_experts * h] + expert * (cfg.num_experts // ep)
        shared = cfg.moe_shared_expert_intermediate_size  # after the experts, whole on each
        gate = [h] if shared and cfg.moe_shared_expert_gate else []  # expert-parallel rank
        return out + (_mlp(cfg, shared, t) + gate if shared else [])
    return out + _mlp(cfg, f, t)


def mtp_tensors(cfg: GPTConfig, tp: int, ep: int = 1, experts: bool | None = None) -> list[int]:
    """Multi-token prediction's depths on the last stage (models.mtp, registered after the
    chunk's layers): each its enorm and hnorm, eh_proj (column-parallel, h/t x 2h, no bias),
    one transformer layer of the last decoder layer's kind (an MoE layer's experts E/``ep``
    of them, as the decoder's), and its final norm; none without. ``experts``: as
    chunk_tensors' (True: the depths' experts alone, False: all but them)."""
    h, out = cfg.hidden_size, []
    for k in range(cfg.mtp_num_layers or 0):
        layer = _layer_part(cfg, tp, cfg.num_layers + k, ep, experts)
        if experts is True:
            out += layer
        else:
            out += [*_norm(cfg), *_norm(cfg), h // tp * 2 * h, *layer, *_norm(cfg)]
    return out


def _layer_part(cfg: GPTConfig, tp: int, layer: int, ep: int, experts: bool | None) -> list[int]:
    """Layer ``layer``'s tensors (layer_tensors), with ``experts`` True its routed experts'
    alone, False all but them (expert parallelism's two bucket sets), None all."""
    tensors = layer_tensors(cfg, tp, layer, ep)
    if experts is None:
        return tensors
    # The experts follow the router; the shared experts (dense: replicated) follow them.
    stop = len(tensors) - _shared_tensors(cfg, layer)
    start = stop - _expert_tensors(cfg, layer, ep)
    return tensors[start:stop] if experts else tensors[:start] + tensors[stop:]


def _mlp(cfg: GPTConfig, f: int, t: int) -> list[int]:
    """A tensor-parallel MLP of width ``f``: the column-parallel product (two under SwiGLU),
    then the row-parallel one, with their biases where the model has them."""
    h = cfg.hidden_size
    column = [f // t * h, *([f // t] if cfg.bias else [])]
    out = column + (column if cfg.activation == "swiglu" else [])
    return out + [h * f // t, *([h] if cfg.bias else [])]


@dataclass(frozen=True)
class ChunkTensors:
    tensors: list[int]  # element counts, registration order
    tied: int | None  # index of the tied embedding when it must sit in a bucket of its own


def chunk_tensors(
    cfg: GPTConfig,
    tp: int,
    pp: int,
    pp_rank: int,
    chunks: int,
    v_shape: bool = False,
    first: int | None = None,
    last: int | None = None,
    ep: int = 1,
    experts: bool | None = None,
) -> list[ChunkTensors]:
    """The parameters of each model chunk of pipeline rank ``pp_rank``, as megart builds them
    (megart.models.gpt.GPTChunk); ``v_shape``: zb-v's placement (the last stage on rank 0);
    ``first``/``last``: uneven stages' layers (megart.models.stages); ``ep``: expert-parallel
    ranks sharing each MoE layer's experts. ``experts`` True: the experts' tensors alone,
    False: all but them (expert parallelism's two bucket sets, training.expert_grads); None:
    all."""
    h, vocab = cfg.hidden_size, cfg.padded_vocab_size(tp) // tp
    untied = cfg.untie_embeddings_and_output_weights
    # Multi-token prediction's depths look tokens up on the last stage: it holds the word
    # embedding even when the output layer has its own, and shares its gradient with the first
    # stage's (training.optimizer._tied_embeddings).
    mtp = bool(cfg.mtp_num_layers)
    out = []
    for layers in chunk_layers(cfg.num_layers, pp_rank, pp, chunks, v_shape, first, last):
        first, last = layers.start == 0, layers.stop == cfg.num_layers
        tensors, tied = [], None
        dense = experts is not True
        if dense and (first or (last and (not untied or mtp))):
            if pp > 1 and (not untied or mtp):
                tied = len(tensors)
            tensors.append(vocab * h)
        if dense and first and cfg.position_embedding == "learned":
            tensors.append(cfg.seq_length * h)
        for i in layers:
            tensors += _layer_part(cfg, tp, i, ep, experts)
        if last:  # the depths (their experts in the experts' set), then the final norm
            tensors += mtp_tensors(cfg, tp, ep, experts) + (_norm(cfg) if dense else [])
        if dense and last and untied:
            tensors.append(vocab * h)
        out.append(ChunkTensors(tensors, tied))
    return out


def expert_elements(
    cfg: GPTConfig,
    tp: int,
    pp: int,
    pp_rank: int,
    chunks: int,
    v_shape: bool = False,
    first: int | None = None,
    last: int | None = None,
    ep: int = 1,
) -> int:
    """The elements of the routed experts' weights pipeline rank ``pp_rank`` holds (its E/ep
    of each of its MoE layers', split over ``tp``)."""
    where = (cfg, tp, pp, pp_rank, chunks, v_shape, first, last, ep)
    return sum(sum(c.tensors) for c in chunk_tensors(*where, experts=True))


def _shared_tensors(cfg: GPTConfig, layer: int) -> int:
    """How many of layer ``layer``'s tensors are its shared experts' (one MLP, no biases, and
    their gate's weight)."""
    if not cfg.is_moe_layer(layer) or not cfg.moe_shared_expert_intermediate_size:
        return 0
    return (3 if cfg.activation == "swiglu" else 2) + int(cfg.moe_shared_expert_gate)


def _expert_tensors(cfg: GPTConfig, layer: int, ep: int) -> int:
    """How many of layer ``layer``'s tensors are its experts' (E/ep MLPs without biases)."""
    if not cfg.is_moe_layer(layer):
        return 0
    return cfg.num_experts // ep * (3 if cfg.activation == "swiglu" else 2)


def buckets(
    chunks: list[ChunkTensors], parts: int, bucket_elements: int | None = None
) -> list[list[int]]:
    """The gradient buckets (element counts of their parameters, in bucket order) that
    megart.training.grad_sync.GradientBuckets makes: parameters in reverse order, a new bucket
    past BUCKET_BYTES (with ``bucket_elements``, --ddp-bucket-size/--ddp-num-buckets: once a
    bucket holds that many elements or more, Megatron's rule), the tied embedding alone."""
    flat, lone = [], set()
    for c in chunks:
        if c.tied is not None:
            lone.add(len(flat) + c.tied)
        flat += c.tensors
    out: list[list[int]] = []
    current: list[int] = []
    size, current_lone = 0, False
    for i in reversed(range(len(flat))):
        n = flat[i]
        if bucket_elements is None:
            full = size + n * FP32 > BUCKET_BYTES
        else:
            full = size >= bucket_elements
        if current and (full or i in lone or current_lone):
            out.append(current)
            current, size = [], 0
        current_lone = i in lone if not current else current_lone
        current.append(n)
        size += n if bucket_elements is not None else n * FP32
    if current:
        out.append(current)
    return out


def padded(bucket: list[int], parts: int) -> int:
    n = sum(bucket)
    return -(-n // parts) * parts


@dataclass(frozen=True)
class StateBytes:
    parameters: int
    gradients: int  # the fp32 gradient buffers
    optimizer: int
    # --grad-reduce-in-bf16: each bucket's bf16 copy, what is reduced (grad_sync's _Bucket)
    reduce_copies: int = 0
    # Elements per bucket from --ddp-bucket-size/--ddp-num-buckets (None: megart's 4 MiB)
    bucket_elements: int | None = None
    # Under expert parallelism, of ``gradients`` the experts' buckets (training.expert_grads:
    # averaged over the expert-data-parallel ranks, apart from the dense ones); 0 without it
    expert_gradients: int = 0


@functools.lru_cache(maxsize=4096)
def state_bytes(
    cfg: GPTConfig,
    tp: int,
    pp: int,
    pp_rank: int,
    chunks: int,
    dp: int,
    distributed: bool,
    dp_rank: int | None = None,
    v_shape: bool = False,
    half_weights: bool = False,
    first: int | None = None,
    last: int | None = None,
    ddp_bucket_size: int | None = None,
    ddp_num_buckets: int | None = None,
    reduce_in_bf16: bool = False,
    ep: int = 1,
) -> StateBytes:
    """Bytes of parameters, gradients and AdamW state (two fp32 moments and a 0-d fp32 step per
    stepped tensor) on data-parallel rank ``dp_rank`` of pipeline rank ``pp_rank`` (None: the
    worst one); ``v_shape``: zb-v's placement. ``half_weights``: 16-bit weights, and fp32 main
    weights in the optimizer state (with the distributed optimizer: of the rank's padded slice
    of each bucket). ``first``/``last``: uneven stages' layers (megart.models.stages).
    ``ddp_bucket_size``/``ddp_num_buckets``: Megatron's bucket sizes, as megart.training.optimizer
    applies them (over this rank's parameters, ``dp`` ranks); ``reduce_in_bf16``
    (--grad-reduce-in-bf16): the gradients stay fp32 and each bucket gets a bf16 copy that is
    reduced, kept beside it (``reduce_copies``); the bucket size it used: ``bucket_elements``.
    ``ep``: expert-parallel ranks sharing each MoE layer's experts, whose buckets are a set of
    their own (training.expert_grads: ``expert_gradients``), sharded by the distributed
    optimizer over their dp / ep expert-data-parallel ranks (the rank's index there d // ep)."""
    chunk_list = chunk_tensors(cfg, tp, pp, pp_rank, chunks, v_shape, first, last, ep)
    n = sum(sum(c.tensors) for c in chunk_list)
    bucket_size = None
    if ddp_bucket_size is not None or ddp_num_buckets is not None:
        bucket_size = megatron_bucket_size(n, dp, ddp_bucket_size, ddp_num_buckets)
    # (buckets, ranks sharding them, data-parallel ranks per index among those)
    sets = [(buckets(chunk_list, 1, bucket_size), dp if distributed else 1, 1)]
    if ep > 1:
        where = (cfg, tp, pp, pp_rank, chunks, v_shape, first, last, ep)
        experts = buckets(chunk_tensors(*where, experts=True), 1, bucket_size)
        sets = [
            (buckets(chunk_tensors(*where, experts=False), 1, bucket_size), sets[0][1], 1),
            (experts, dp // ep if distributed else 1, ep),
        ]
    padded_sets = [sum(padded(b, parts) for b in bs) for bs, parts, _ in sets]
    grads = sum(padded_sets) * FP32
    expert_grads = padded_sets[1] * FP32 if ep > 1 else 0
    copies = grads // FP32 * 2 if reduce_in_bf16 else 0
    tensors = sum(len(c.tensors) for c in chunk_list)
    weight = 2 if half_weights else FP32
    if not distributed:
        mains = n * FP32 if half_weights else 0
        optimizer = n * 2 * FP32 + tensors * FP32 + mains
        return StateBytes(n * weight, grads, optimizer, copies, bucket_size, expert_grads)
    # This rank's slice of every padded bucket.
    slices = sum(total // parts for total, (_, parts, _) in zip(padded_sets, sets, strict=True))
    mains = slices * FP32 if half_weights else 0
    # The distributed optimizer moves the parameters into buffers laid out (padded) as the
    # gradients, and steps 1/dp slices ("pieces") of them: moments for the elements of its
    # slice that belong to parameters, a step per piece.
    if dp_rank is not None:
        ranks: range | tuple[int, ...] = (dp_rank,)
    else:
        # Every rank for small models (exact); rank 0, which holds whole slices, for large.
        count = sum(len(bs) for bs, _, _ in sets)
        ranks = range(dp) if count * dp <= 4096 else (0,)
    worst = 0
    for r in ranks:
        elements = pieces = 0
        for bs, parts, per in sets:
            e, k = _slice_state(bs, parts, r // per)
            elements, pieces = elements + e, pieces + k
        worst = max(worst, elements * 2 * FP32 + pieces * FP32)
    return StateBytes(grads // FP32 * weight, grads, worst + mains, copies, bucket_size,
                      expert_grads)  # fmt: skip


def _slice_state(bs: list[list[int]], parts: int, r: int) -> tuple[int, int]:
    """(elements of parameters, pieces) in slice ``r`` of ``parts`` of each bucket of ``bs``."""
    elements = pieces = 0
    for b in bs:
        size = padded(b, parts) // parts
        lo, hi, offset = r * size, (r + 1) * size, 0
        for n_p in b:
            start, end = max(lo, offset), min(hi, offset + n_p)
            if start < end:
                elements += end - start
                pieces += 1
            offset += n_p
    return elements, pieces
