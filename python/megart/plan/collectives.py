"""Time of the collectives megart plan counts (the tensor-parallel ones plan.timing counts, an
MoE layer's dispatcher's among them, and plan.data_parallel's): nccl-tests' model of a ring
collective over a bus, and how much of one layer's backward tensor-parallel collectives stays
exposed beside its products (BACKWARD_OVERLAP, Megatron-LM's, or KEPT_INPUT_OVERLAP,
megart's)."""

from __future__ import annotations

from megart.plan.hardware import GPUProfile

# nccl-tests' busbw factors: bytes on the wire per rank over the buffer's size, for n ranks.
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
}


def collective_seconds(
    kind: str, nbytes: float, ranks: int, bus_gb_per_s: float, gpu: GPUProfile
) -> float:
    """nccl-tests' model of a ring collective (``kind`` one of BUS_FACTOR's) of an ``nbytes``
    buffer over ``ranks``: bytes x factor / busbw, plus one latency per step of the ring (an
    all-reduce is a reduce-scatter then an all-gather: 2(n-1) steps)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = (ranks - 1) * (2 if kind == "all_reduce" else 1)
    factor = BUS_FACTOR[kind](ranks)
    return nbytes * factor / (bus_gb_per_s * 1e9) + steps * gpu.link_latency_us * 1e-6


# Megatron-LM's asynchronous backward collectives of its column-parallel linears
# (LinearWithGradAccumulationAndAsyncCommunication): without sequence parallelism the input
# gradient's all-reduce runs beside the weight-gradient product (--async-tensor-model-parallel-
# allreduce, 16c90445e7, September 2021); with it (9aad9203aa, May 2022) the input's re-gather
# runs beside the input-gradient product and the input gradient's reduce-scatter beside the
# weight-gradient product. Forward collectives, and the row-parallel linears' backward all-gather
# of the output gradient under sequence parallelism, are not overlapped.
BACKWARD_OVERLAP = "backward"
# megart's (tensor_parallel.column_entry, since 2026-11-28): the same reduce-scatter or
# all-reduce beside the weight-gradient products, but no re-gather: megart keeps the gathered
# input of a column-parallel product (plan.activations counts it).
KEPT_INPUT_OVERLAP = "backward, gathered input kept"
BACKWARD_MODES = (BACKWARD_OVERLAP, KEPT_INPUT_OVERLAP)


def tp_backward_seconds(
    nbytes: float, t: int, sp: bool, columns: list[float], gpu: GPUProfile, regather: bool = True
) -> float:
    """The exposed tensor-parallel time of one layer's backward under BACKWARD_OVERLAP
    (``regather``) or KEPT_INPUT_OVERLAP: ``columns``, the forward times of the two
    column-parallel products (each backward product takes as long; an MoE layer's attention's
    alone, its experts' collectives being its own); ``nbytes`` one layer activation."""
    bus = gpu.nvlink_bus_gb_per_s
    if not sp:
        reduce = collective_seconds("all_reduce", nbytes, t, bus, gpu)
        return sum(max(0.0, reduce - g) for g in columns)
    gather = collective_seconds("all_gather", nbytes, t, bus, gpu)
    scatter = collective_seconds("reduce_scatter", nbytes, t, bus, gpu)
    # The row-parallel products' output gradients (one per column-parallel one), gathered.
    rows = len(columns) * gather
    again = gather if regather else 0.0
    return rows + sum(max(0.0, again - g) + max(0.0, scatter - g) for g in columns)
