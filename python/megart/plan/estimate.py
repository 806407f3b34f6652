"""One layout on one cluster: memory per GPU by part (worst rank) and the time of one iteration
by part, with the pipeline bubble from megart's schedule simulator."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from megart.models import GPTConfig
from megart.models.window import layer_window
from megart.plan.data_parallel import (
    bucket_elements_of,
    data_parallel_bus_gb_per_s,
    data_parallel_seconds,
)
from megart.plan.hardware import GIB, GPUProfile
from megart.plan.layout import Layout, layout_config
from megart.plan.memory import precision, sixteen_bit_weights
from megart.plan.moe_time import expert_group_near
from megart.plan.mtp_time import mtp_work
from megart.plan.parameters import FP32
from megart.plan.pipeline_run import PipelineRun, pipeline_run
from megart.plan.runtime_options import check_runtime, gradient_copy_bytes, runtime_tp_overlap
from megart.plan.timing import Work, layer_work, logits_work
from megart.plan.worst_rank import worst_rank_memory
from megart.training.config import TrainConfig
from megart.training.flops import model_flops, moe_layer_count, replayed_layers
from megart.training.layer_placement import (
    every_rank_layers,
    replayed_layer_count,
    replayed_moe_layer_count,
)

ADAM_BYTES = 28  # per fp32 element stepped: read p, g, m, v; write p, m, v (REFERENCES.md)


@dataclass
class Estimate:
    layout: Layout
    num_layers: int
    microbatches: int
    memory: dict[str, float]  # bytes per GPU by part, the worst rank
    time: dict[str, float]  # seconds by part; "iteration" is their sum
    bubble_fraction: float
    fits: bool
    missing_bytes: float
    tflops_per_gpu: float  # counting recomputation (the paper's convention)
    model_tflops_per_gpu: float
    mfu: float
    simulated: bool
    peak_in_flight: list[int] = field(default_factory=list)  # pairs held from F to B (or W)
    # Zero-bubble schedules: of those, the pairs between I and W at each rank's largest memory.
    held_for_weights: list[int] = field(default_factory=list)
    stage: Work | None = None  # one microbatch through the slowest stage (what was simulated)
    # Uneven stages: one microbatch through each pipeline rank's stage (simulated as such).
    stages: list[Work] = field(default_factory=list)

    @property
    def iteration_time(self) -> float:
        return self.time["iteration"]


def estimate(
    base: TrainConfig,
    layout: Layout,
    gpu: GPUProfile,
    simulate: bool = True,
    unfused_attention: bool = False,
    runtime: str = "megart",
    tp_overlap: bool | str | None = None,
    dp_overlap: bool | str = True,
    grad_reduce_bytes: int = FP32,
    pp_overlap: bool = True,
    interleaved_min_pp: int = 2,
    fp32_grad_copies: bool = False,
) -> Estimate:
    """Predicts ``layout`` for the model and batch of ``base`` on ``gpu``s. Raises ConfigError
    (megart train's checks) when the layout cannot run.

    ``runtime`` "megart" counts what megart holds (fp32 weights, gradients and moments, or with
    --half-weights 16-bit weights and fp32 main weights as Megatron-LM; a 16-bit
    residual stream under autocast unless --fp32-residual-connection; pipeline outputs kept until
    backward); "megatron" counts Megatron-LM's conventions, which the published tables were measured
    with (bf16 weights, fp32 gradients, fp32 main weights and moments; Korthikanti et al.'s
    activations; 16-bit pipeline messages; outputs freed once sent). ``tp_overlap``, ``dp_overlap``
    and ``grad_reduce_bytes`` describe the runtime's communication: megart's is the default
    (the column-parallel products' backward collectives beside their weight gradients, gradient
    buckets reduced in fp32 during the last backward, pipeline messages sent while the next
    action computes). ``pp_overlap`` False: every
    pipeline exchange blocks both ranks until it has arrived, as SC21's Megatron-LM did (its
    p2p_communication waited on each batch_isend_irecv and then synchronised the device), so each
    (microbatch, chunk) pays one exchange after its forward and one after its backward.
    ``tp_overlap`` "backward" (collectives.BACKWARD_OVERLAP): Megatron-LM's asynchronous backward
    collectives of its column-parallel products (2021-2022), not those of the forward; None:
    the runtime's own (megart's: collectives.KEPT_INPUT_OVERLAP; "megatron": BACKWARD_OVERLAP).
    ``dp_overlap`` "single-stage": overlapped only when p = 1 (SINGLE_STAGE). With runtime "megart"
    ``base``'s flags decide instead (--no-overlap-grad-reduce, --grad-reduce-in-bf16,
    --ddp-bucket-size, --ddp-num-buckets), and ``dp_overlap``/``grad_reduce_bytes`` other than
    their defaults are refused. A runtime that
    interleaves only from ``interleaved_min_pp`` stages (SC21's Megatron-LM: 3) refuses interleaved
    layouts on fewer with ConfigError. ``fp32_grad_copies``: the 16-bit gradients and the
    optimizer's fp32 copies of them that SC21's Megatron-LM held (and torch DDP's buckets where
    it ran: runtime_options.gradient_copy_bytes); False counts one fp32 gradient per element."""
    check_runtime(
        layout, runtime, dp_overlap, interleaved_min_pp, grad_reduce_bytes, fp32_grad_copies
    )
    tp_overlap = runtime_tp_overlap(runtime, tp_overlap, layout)
    c = layout_config(base, layout)
    world = layout.world
    dp = c.check(world)  # megart train's checks, context parallelism's refusals included
    cfg = c.gpt_config()
    m = c.microbatches(dp)
    prec = precision(c, runtime)

    stage, stages = _stage_work(c, cfg, layout, gpu, unfused_attention, tp_overlap)
    run = pipeline_run(
        c, cfg, layout, dp, gpu, stage, prec.residual, m, simulate, pp_overlap, runtime, stages
    )
    copies = gradient_copy_bytes(fp32_grad_copies, grad_reduce_bytes, dp_overlap, layout.pp)
    worst, held = worst_rank_memory(c, cfg, layout, dp, run, runtime, unfused_attention, copies)
    worst["allowance"] = gpu.memory_gib * GIB - gpu.usable_bytes
    dp_time = _data_parallel_time(c, cfg, layout, gpu, worst, run, runtime, dp_overlap,
                                  grad_reduce_bytes)  # fmt: skip
    time = _time_parts(layout, gpu, worst, run, m, dp_time)
    flops_model, flops_run = _flops(c, cfg)
    tflops = flops_run / time["iteration"] / world / 1e12
    model_tflops = flops_model / time["iteration"] / world / 1e12
    missing = worst["total"] - gpu.usable_bytes
    return Estimate(
        layout=_returned_layout(layout, c, dp),
        num_layers=cfg.num_layers,
        microbatches=m,
        memory=worst,
        time=time,
        bubble_fraction=run.bubble,
        fits=missing <= 0,
        missing_bytes=max(0.0, missing),
        tflops_per_gpu=tflops,
        model_tflops_per_gpu=model_tflops,
        mfu=model_tflops / gpu.peak_tflops,
        simulated=run.plan is not None,
        peak_in_flight=list(run.in_flight),
        held_for_weights=[h.weight_grads for h in held],
        stage=run.stage,
        stages=run.stages,
    )


def _data_parallel_time(
    c: TrainConfig,
    cfg: GPTConfig,
    layout: Layout,
    gpu: GPUProfile,
    worst: dict[str, float],
    run: PipelineRun,
    runtime: str,
    dp_overlap: bool | str,
    grad_reduce_bytes: int,
) -> tuple[float, float, float]:
    """data_parallel_seconds for the worst rank's gradients: megart train's flags decide its
    runtime's communication, the caller's options Megatron-LM's."""
    bucket = None
    if runtime == "megart":
        dp_overlap = c.overlap_grad_reduce
        grad_reduce_bytes = 2 if c.grad_reduce_in_bf16 else FP32
        bucket = bucket_elements_of(worst)
    # Gradients are averaged, and the distributed optimizer sharded, over the d x cp ranks.
    return data_parallel_seconds(
        cfg,
        layout,
        layout.dp_cp,
        gpu,
        worst["gradient_buffers"],
        run.stage.backward,
        sixteen_bit_weights(c, runtime),
        dp_overlap,
        grad_reduce_bytes,
        bucket,
        worst["expert_gradient_buffers"],
    )


def _time_parts(
    layout: Layout,
    gpu: GPUProfile,
    worst: dict[str, float],
    run: PipelineRun,
    m: int,
    dp_time: tuple[float, float, float],
) -> dict[str, float]:
    """An iteration's seconds by part, and the whole ("iteration"): the pipeline's makespan,
    then what data-parallel communication outlasts it, then the optimizer's step (a pass over
    the rank's stepped fp32 state at HBM speed)."""
    dp_exposed, gather, tied = dp_time
    stepped = worst["gradient_buffers"] / FP32
    if layout.distributed_optimizer:  # the experts' slices are 1/(d / ep) of theirs
        experts = worst["expert_gradient_buffers"] / FP32
        stepped = (stepped - experts) / layout.dp_cp + experts / (layout.dp_cp // layout.ep)
    optimizer = stepped * ADAM_BYTES / (gpu.hbm_gb_per_s * 1e9)
    bubble, compute_only = run.bubble, run.compute_only
    pipeline_comm = run.makespan - compute_only * (1 + bubble) if layout.pp > 1 else 0.0
    tp_comm = m * run.stage.tp_comm
    cp_comm = m * run.stage.cp_comm
    ep_comm = m * run.stage.ep_comm
    time = {
        "compute": compute_only - tp_comm - cp_comm - ep_comm,
        "tp_comm": tp_comm,
        "cp_comm": cp_comm,
        "ep_comm": ep_comm,
        "bubble": compute_only * bubble,
        "pp_comm": max(0.0, pipeline_comm),
        "dp_comm": dp_exposed + gather + tied,
        "optimizer": optimizer,
    }
    time["iteration"] = run.makespan + dp_exposed + gather + tied + optimizer
    return time


def _flops(c: TrainConfig, cfg: GPTConfig) -> tuple[int, int]:
    """The global batch's FLOPs: the model's, and what runs (the replayed layers' forward
    again under full recomputation; block: N of each chunk; selective: every attention core's
    and MLP's that --recompute-modules names).
    The paper's count (the whole s x s attention), as SC21's and Megatron-Core's published tables
    were counted; megart train prints Megatron's current, causal count."""
    batch, granularity = c.global_batch_size, cfg.recompute_granularity
    replayed = replayed_layer_count(c, cfg)
    run = model_flops(
        cfg,
        batch,
        recompute=granularity == "full",
        causal=False,
        replayed=replayed,
        selective=cfg.recomputes("core_attn"),
        mlp_again=cfg.recomputes("mlp"),
        replayed_moe=replayed_moe_layer_count(c, cfg),
    )
    return model_flops(cfg, batch, causal=False), run + _moe_again(cfg, batch)


def _moe_again(cfg: GPTConfig, batch: int) -> int:
    """--recompute-modules moe or shared_experts: every MoE layer's expert products once more
    as training.flops counts them (Megatron's: each token's k experts' and the shared experts'
    width, k f + S), or the shared experts' alone (S); the router's are not counted."""
    shared = cfg.moe_shared_expert_intermediate_size or 0
    if cfg.recomputes("moe"):
        width = cfg.moe_ffn_size * cfg.moe_router_topk + shared
    else:
        width = shared if cfg.recomputes("shared_experts") else 0
    passes = (3 if cfg.activation == "swiglu" else 2) * 2
    return moe_layer_count(cfg) * passes * batch * cfg.seq_length * cfg.hidden_size * width


def _returned_layout(layout: Layout, c: TrainConfig, dp: int) -> Layout:
    """The layout as estimated: its data-parallel size, and under full recomputation the
    spans (--recompute-method, --recompute-num-layers) where they are not the defaults."""
    out = dataclasses.replace(layout, dp=dp)
    given = dataclasses.replace(
        out, recompute_method=c.recompute_method, recompute_num_layers=c.recompute_num_layers
    )
    return given if layout.recompute == "full" and given.spans_given else out


def work_bound(
    base: TrainConfig,
    layout: Layout,
    gpu: GPUProfile,
    unfused_attention: bool = False,
    tp_overlap: bool | str | None = None,
    runtime: str = "megart",
    **_: object,
) -> float:
    """A lower bound of estimate()'s iteration time for the same options, found without its
    memory or schedule: the m microbatches' forward and backward of the busiest pipeline rank,
    which no schedule shortens (no bubble, no exchange, no step counted). Raises ConfigError
    as estimate() does for a layout megart train refuses."""
    c = layout_config(base, layout)
    dp = c.check(layout.world)
    tp_overlap = runtime_tp_overlap(runtime, tp_overlap, layout)
    stage, _ = _stage_work(c, c.gpt_config(), layout, gpu, unfused_attention, tp_overlap)
    return c.microbatches(dp) * (stage.forward + stage.backward)


def _stage_work(
    c: TrainConfig,
    cfg: GPTConfig,
    layout: Layout,
    gpu: GPUProfile,
    unfused_attention: bool,
    tp_overlap: bool | str,
) -> tuple[Work, list[Work]]:
    """One microbatch through the slowest stage (even stages: the last, which adds the output
    layer), and with uneven stages through each rank's (else an empty list)."""
    t, p, v, b, sp = layout.sizes()
    cp = layout.cp
    # A tensor-parallel group that does not divide a node spans nodes: its collectives cross
    # the rails. Context-parallel ranks sit t apart (ranks tp-cp-dp-pp), as data-parallel ones
    # do without them: inside a node while t x cp GPUs fit in one, else over the rails.
    tp_gpu = gpu
    if gpu.gpus_per_node % t:
        tp_gpu = dataclasses.replace(gpu, nvlink_bus_gb_per_s=gpu.rail_gb_per_s)
    cp_bus = data_parallel_bus_gb_per_s(gpu, t, cp)
    rec = cfg.recompute_granularity
    # Each layer's work by its sliding window (None: full causal attention).
    windows = [layer_window(cfg.window_size, cfg.window_attn_skip_freq, i)
               for i in range(cfg.num_layers)]  # fmt: skip
    # Full recomputation replays the layers --recompute-method/--recompute-num-layers pick
    # (block: the first N of each chunk; the others run as without recomputation).
    kinds = {rec} | ({None} if rec == "full" and cfg.recompute_method == "block" else set())
    # Each layer's kind: (window, MoE layer or not).
    layer_kinds = [(windows[i], cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    # Expert parallelism's groups: ep ranks t apart, split over nodes where they must be.
    ep = layout.ep
    near = expert_group_near(gpu.gpus_per_node, layout.dp, p, ep, t, cp) if ep > 1 else None
    works = {
        (w, r): layer_work(cfg, b, t, sp, r, tp_gpu, unfused_attention, tp_overlap, cp=cp,
                           cp_bus_gb_per_s=cp_bus, window=w[0], documents=c.reset_attention_mask,
                           moe=w[1], ep=ep, ep_near=near)
        for w in set(layer_kinds) for r in kinds
    }  # fmt: skip
    logits = logits_work(cfg, b, t, gpu, cp)
    # Multi-token prediction's depths run on the last stage with its loss (plan.mtp_time).
    logits += mtp_work(cfg, b, t, sp, gpu, tp_gpu, unfused_attention, tp_overlap, ep, near, cp,
                       cp_bus)  # fmt: skip
    # Each rank's layers as megart train places them (zb-v's V: rank 0 holds the first and the
    # last chunk, so the output layer too). Uneven stages, and ranks whose layers differ in
    # windows or recomputation, are simulated with each rank's own costs; a split that is even
    # after all is the even layout.
    counts = layout.layer_counts(cfg.num_layers)
    ranks = []
    for placed in every_rank_layers(c):
        held = Counter(
            (layer_kinds[chunk[i]], rec if again else None)
            for chunk in placed
            for i, again in enumerate(_runs_recomputation(len(chunk), cfg))
        )
        ranks.append(sum((works[w] * n for w, n in held.items()), Work(0.0, 0.0, 0.0)))
    output_rank = 0 if layout.kind == "zb-v" else p - 1
    stage = ranks[output_rank] + logits
    stages = []
    if len(set(counts)) > 1 or len(set(ranks)) > 1:
        stages = list(ranks)
        stages[output_rank] = stages[output_rank] + logits
        stage = max(stages, key=lambda w: w.forward + w.backward)
    return stage, stages


def _runs_recomputation(layers: int, cfg: GPTConfig) -> list[bool]:
    """Whether each of a chunk's ``layers`` layers runs the granularity's recomputation: all
    of them, but under full recomputation only those it replays (training.flops'
    replayed_layers: with --recompute-method block the first N)."""
    if cfg.recompute_granularity != "full":  # the method picks nothing then
        return [True] * layers
    return replayed_layers(cfg, layers)
