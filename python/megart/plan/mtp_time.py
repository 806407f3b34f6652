"""Multi-token prediction's depths (--mtp-num-layers D, megart.models.mtp) in plan.timing's
model: the last stage's extra work per microbatch, beside its output layer (estimate's
_stage_work adds it there). Each depth runs one layer of the last decoder layer's kind
(timing.layer_work, recomputed as the depth is: whole under full uniform recomputation, not
under block; an MoE layer's router, experts and expert-parallel all-to-alls as the decoder's
MoE layers'), its
eh_proj product (2h -> h/t over the tokens, backward twice that), the output layer and loss
over its tokens (timing.logits_work) and, at t > 1, eh_proj's collectives: its 2h input
gathered under sequence parallelism (reduce-scattered back) or its input gradient all-reduced
without, and its h output gathered (sliced again under sequence parallelism: the slice's
gradient gathered). Their FLOPs are training.flops.mtp_flops' (TFLOP/s, MFU).

Under context parallelism each depth runs this rank's s/cp tokens, its layer with the
--cp-comm-type exchanges of the decoder's (timing.layer_work), and the depths' shifts along the
whole sequence (models.mtp_sequence) all-gather over the cp group once per microbatch, forward
only, the [b, s/cp] parts of: the tokens (int64), the labels (int64) and the loss mask (fp32)
(mtp_sequence_gathers; with per-document positions, --reset-position-ids, their int64 too, not
counted here)."""

from __future__ import annotations

from megart.models.config import GPTConfig
from megart.plan.collectives import collective_seconds
from megart.plan.hardware import GPUProfile
from megart.plan.timing import ACT, Work, gemm_seconds, layer_work, logits_work


def mtp_work(
    cfg: GPTConfig,
    b: int,
    tp: int,
    sp: bool,
    gpu: GPUProfile,
    tp_gpu: GPUProfile,
    unfused_attention: bool = False,
    tp_overlap: bool | str = False,
    ep: int = 1,
    ep_near: int | None = None,
    cp: int = 1,
    cp_bus_gb_per_s: float | None = None,
) -> Work:
    """The D depths' work for one microbatch on the last stage (none without them); ``tp_gpu``
    the profile of the tensor-parallel group's links (estimate._stage_work's); ``ep`` and
    ``ep_near``: an MoE depth's experts' group; ``cp`` and ``cp_bus_gb_per_s``: context
    parallelism's ranks and their links (timing.layer_work's)."""
    depths = cfg.mtp_num_layers or 0
    if not depths:
        return Work(0.0, 0.0, 0.0)
    rec = cfg.recompute_granularity
    replay = rec == "full" and cfg.recompute_method == "uniform"
    layer_rec = None if rec == "full" and not replay else rec
    moe = cfg.is_moe_layer(cfg.num_layers)  # the depths' layers are the last decoder layer's kind
    layer = layer_work(cfg, b, tp, sp, layer_rec, tp_gpu, unfused_attention, tp_overlap,
                       cp=cp, cp_bus_gb_per_s=cp_bus_gb_per_s, moe=moe, ep=ep,
                       ep_near=ep_near)  # fmt: skip
    h, tokens = cfg.hidden_size, cfg.seq_length // cp * b
    proj = gemm_seconds(tokens, h / tp, 2 * h, gpu)
    link = tp_gpu.nvlink_bus_gb_per_s
    forward_comm = backward_comm = 0.0
    if tp > 1:
        joined, out = tokens * 2 * h * ACT, tokens * h * ACT
        gather = collective_seconds("all_gather", out, tp, link, tp_gpu)
        forward_comm = gather
        if sp:
            forward_comm += collective_seconds("all_gather", joined, tp, link, tp_gpu)
            backward_comm = collective_seconds("reduce_scatter", joined, tp, link, tp_gpu)
            backward_comm += gather
        else:
            backward_comm = collective_seconds("all_reduce", joined, tp, link, tp_gpu)
    forward = proj + forward_comm
    backward = 2 * proj + backward_comm + (forward if replay else 0.0)
    comm = forward_comm + backward_comm + (forward_comm if replay else 0.0)
    depth = Work(forward, backward, comm, proj) + layer + logits_work(cfg, b, tp, gpu, cp)
    bus = gpu.nvlink_bus_gb_per_s if cp_bus_gb_per_s is None else cp_bus_gb_per_s
    shifts = sum(collective_seconds("all_gather", n * size, cp, bus, gpu)
                 for n, size in mtp_sequence_gathers(cfg, b, cp))  # fmt: skip
    return depth * depths + Work(shifts, 0.0, 0.0, cp_comm=shifts)


def mtp_sequence_gathers(cfg: GPTConfig, b: int, cp: int) -> list[tuple[int, int]]:
    """The depths' all-gathers over the cp group per microbatch (see the module's doc), each
    as (elements of the rank's own part, bytes per element); none without cp or depths."""
    if cp <= 1 or not cfg.mtp_num_layers:
        return []
    part = cfg.seq_length // cp * b
    return [(part, 8), (part, 8), (part, 4)]  # tokens, labels, the loss mask
