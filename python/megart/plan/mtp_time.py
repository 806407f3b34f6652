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
gradient gathered). Their FLOPs are training.flops.mtp_flops' (TFLOP/s, MFU)."""

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
) -> Work:
    """The D depths' work for one microbatch on the last stage (none without them); ``tp_gpu``
    the profile of the tensor-parallel group's links (estimate._stage_work's); ``ep`` and
    ``ep_near``: an MoE depth's experts' group (timing.layer_work's)."""
    depths = cfg.mtp_num_layers or 0
    if not depths:
        return Work(0.0, 0.0, 0.0)
    rec = cfg.recompute_granularity
    replay = rec == "full" and cfg.recompute_method == "uniform"
    layer_rec = None if rec == "full" and not replay else rec
    moe = cfg.is_moe_layer(cfg.num_layers)  # the depths' layers are the last decoder layer's kind
    layer = layer_work(cfg, b, tp, sp, layer_rec, tp_gpu, unfused_attention, tp_overlap,
                       moe=moe, ep=ep, ep_near=ep_near)  # fmt: skip
    h, tokens = cfg.hidden_size, cfg.seq_length * b
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
    depth = Work(forward, backward, comm, proj) + layer + logits_work(cfg, b, tp, gpu)
    return depth * depths
