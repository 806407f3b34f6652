"""The data-parallel part of an iteration's time: the bus a data-parallel (or context-parallel)
group's collectives get, and what of the gradient reduction, the distributed optimizer's
all-gather and the tied embedding's all-reduce is left after the last backward."""

from __future__ import annotations

from megart.models import GPTConfig
from megart.plan.collectives import collective_seconds
from megart.plan.hardware import GPUProfile, group_ranks_per_node
from megart.plan.layout import Layout
from megart.plan.parameters import BUCKET_BYTES, FP32

# dp_overlap="single-stage": the gradient all-reduce overlaps the last microbatch's backward
# only with p = 1, as in SC21's Megatron-LM: its p = 1 runs used --DDP-impl torch (its
# examples/sc21), whose no_sync() spared only the last microbatch (schedules.py), so its 25 MiB
# buckets were reduced during that backward; p > 1 required local DDP, reduced after it all.
SINGLE_STAGE = "single-stage"
TORCH_DDP_BUCKET_BYTES = 25 << 20


def data_parallel_bus_gb_per_s(gpu: GPUProfile, tp: int, dp: int) -> float:
    """busbw of a data-parallel group's collectives (``dp`` ranks: with context parallelism the
    d x cp ranks that average gradients, or the cp ranks that gather keys and values). Ranks
    are numbered tensor-parallel first (then cp, then dp), so the group's members sit tp apart
    and a node holds k = gpus_per_node / tp of them. Inside
    one node: NVLink. Across nodes, NCCL runs one channel per NIC nearest the group's GPUs, each
    channel entering and leaving a node once (its graph search, src/graph/search.cc;
    NVIDIA/nccl#687), so the group's k GPUs drive k rails at once; the node's other groups use
    the other rails."""
    if tp * dp <= gpu.gpus_per_node:
        return gpu.nvlink_bus_gb_per_s
    return min(group_ranks_per_node(gpu, tp, dp) * gpu.rail_gb_per_s, gpu.nvlink_bus_gb_per_s)


def bucket_elements_of(memory: dict[str, float]) -> float:
    """Elements in one of megart's gradient buckets (megart.training.optimizer.build) on the rank
    whose ``memory`` (plan.memory.rank_memory) is given: Megatron's size from
    --ddp-bucket-size/--ddp-num-buckets as that rank's parameters gave it, else megart's 4 MiB
    of fp32 gradients (the wire dtype does not change the bucket's members)."""
    return memory.get("bucket_elements", BUCKET_BYTES / FP32)


def data_parallel_seconds(
    cfg: GPTConfig,
    layout: Layout,
    dp: int,
    gpu: GPUProfile,
    grad_elements_bytes: float,
    last_backward: float,
    half_weights: bool,
    dp_overlap: bool | str,
    grad_reduce_bytes: int,
    bucket_elements: float | None = None,
    expert_bytes: float = 0.0,
) -> tuple[float, float, float]:
    """Seconds the iteration spends on data-parallel communication after its last backward:
    the gradient reduction's exposed part, the distributed optimizer's all-gather, and the tied
    embedding's all-reduce between the first and last stage. ``grad_elements_bytes``: fp32
    bytes of the worst rank's gradients; ``half_weights``: the weights are 16-bit;
    ``grad_reduce_bytes``: bytes per gradient element on the wire; ``bucket_elements``: the
    elements of a gradient bucket (bucket_elements_of; None: the runtime's bucket bytes over
    ``grad_reduce_bytes``). ``expert_bytes``: of ``grad_elements_bytes``, the experts' buckets
    under expert parallelism (layout.ep > 1), reduced over their expert-data-parallel group
    instead (training.expert_grads: the dp x cp / ep ranks holding the same experts, ep places
    of the dp x cp group apart, t ep global ranks; ``dp`` here is dp x cp), and with the
    distributed optimizer their parameters gathered over it, after or before the dense ones on
    the same links: their times add up."""
    t, p = layout.tp, layout.pp
    dist = layout.distributed_optimizer
    gather_bytes = 2 if half_weights else FP32  # what the distributed optimizer gathers
    # Each bucket is reduced as soon as the last microbatch's backward has produced it, so all
    # but the last bucket overlap that backward.
    grad_bytes = grad_elements_bytes * grad_reduce_bytes / FP32
    dp_bw = data_parallel_bus_gb_per_s(gpu, t, dp)
    # The distributed optimizer reduce-scatters the gradients, then all-gathers the parameters.
    kind = "reduce_scatter" if dist else "all_reduce"
    dense = grad_bytes - expert_bytes * grad_reduce_bytes / FP32
    reduce = collective_seconds(kind, dense, dp, dp_bw, gpu)
    edp, edp_bw = dp // layout.ep, 0.0
    if expert_bytes:
        edp_bw = data_parallel_bus_gb_per_s(gpu, layout.ep * t, edp)
        experts = expert_bytes * grad_reduce_bytes / FP32
        reduce += collective_seconds(kind, experts, edp, edp_bw, gpu)
    if bucket_elements is None:
        bucket = TORCH_DDP_BUCKET_BYTES if dp_overlap == SINGLE_STAGE else BUCKET_BYTES
        bucket_elements = bucket / grad_reduce_bytes
    elements = grad_elements_bytes / FP32
    last_bucket = reduce * min(1.0, bucket_elements / max(elements, 1.0))
    exposed = max(reduce - last_backward, last_bucket) if reduce else 0.0
    if not dp_overlap or (dp_overlap == SINGLE_STAGE and p > 1):
        exposed = reduce
    gather = 0.0
    # The all-gather after the step is exposed whole, with --overlap-param-gather too: megart
    # then leaves it running, but each model chunk's forward first waits for every bucket of
    # its own parameters (DistributedOptimizer.overlap_with_forward), and the first stage's
    # first chunk, whose forward begins the iteration, is gathered last (buckets run in reverse
    # parameter order, one after another on the group).
    if dist:
        params = (grad_elements_bytes - expert_bytes) * gather_bytes / FP32
        gather = collective_seconds("all_gather", params, dp, dp_bw, gpu)
        if expert_bytes:
            experts = expert_bytes * gather_bytes / FP32
            gather += collective_seconds("all_gather", experts, edp, edp_bw, gpu)
    tied = 0.0
    # The tied embedding's two copies: on the first and last ranks, both on rank 0 in zb-v.
    if p > 1 and not cfg.untie_embeddings_and_output_weights and layout.kind != "zb-v":
        emb = cfg.padded_vocab_size(t) // t * cfg.hidden_size * FP32 / (dp if dist else 1)
        tied = collective_seconds("all_reduce", emb, 2, gpu.rail_gb_per_s, gpu)
    return exposed, gather, tied
