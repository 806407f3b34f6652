"""The candidate layouts of megart plan's search: every combination of the flags a user left
open (Fixed) that megart train accepts.

Context parallelism left out is searched (megart's runtime only): C = 1 and each power of two
that cuts the sequence into 2 C chunks and divides the GPUs, its ranks placed as megart's grid
places them (tp-cp-dp-pp: the C ranks t apart, d x C averaging gradients); with each t only the
C that megart train's context-parallel checks accept (--cp-comm-type a2a: heads and query
groups per tensor-parallel rank divisible by C). With C > 1 only micro-batch 1 is tried:
b = 2k at C runs each rank's tokens, the same m, the same FLOPs and gradient traffic as k at
C / 2, whose exchanges are fewer and smaller (and whose gathered keys and values are fewer;
under a2a each of its all-to-alls sends (C/2 - 1)/(C/2) of the same buffer, not (C - 1)/C):
never faster, and never less memory but for the per-microbatch tables of the rank's s/C rows
(rope's cos and sin, learned positions' index). One exception: a2a at C = 2 against one
process with rope keeps less (its attention's 5 h per token against the fused q/k/v output and
rope's q and k, 7 h), and b = 1 at C = 2 less again; a b = 2 at C = 2 faster than b = 1 there,
where one process does not fit, is not looked for.

Expert parallelism left out is searched for MoE models where megart train runs it: beside any
t and cp, each E dividing both d x cp (the data- and context-parallel ranks a group spans) and
--num-experts (E = 1 included), with and without the distributed optimizer (where megart train
refuses both, its check drops those layouts). Given, it is kept, and t and cp are searched
around it (layouts whose d x cp it does not divide are megart train's refusals, dropped).
"""

from __future__ import annotations

import dataclasses
import itertools

from megart.errors import ConfigError
from megart.models.moe_checks import check_moe_tensor_parallel
from megart.parallel.layout import divisors, make_layout
from megart.plan.fixed import Fixed, schedules
from megart.plan.hardware import GPUProfile
from megart.plan.layout import ZERO_BUBBLE, Layout
from megart.training.config import TrainConfig
from megart.training.context_parallel_checks import check_context_parallel

RECOMPUTE = (None, "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16)  # 16: SC21 Table 1 ran 1.7B-7.5B at 16 (Megatron-LM examples/sc21)


def context_parallel_sizes(base: TrainConfig, world: int, fixed: Fixed, megart: bool) -> list[int]:
    """The context-parallel sizes to try: the one given; else 1 and each power of two C that
    cuts the sequence into 2 C equal chunks (megart's load-balanced split) and divides the
    GPUs (candidates keeps those megart train accepts with each t). 1 alone for Megatron-LM's
    runtime, whose exchanges the planner does not model. The ring through windowed layers is
    searched as the others (its pieces inside the window: plan.ring_window_cost)."""
    if fixed.cp is not None:
        return [fixed.cp]
    if not megart:
        return [1]
    out, cp = [1], 2
    while world % cp == 0 and base.seq_length % (2 * cp) == 0:
        out.append(cp)
        cp *= 2
    return out


def candidates(
    base: TrainConfig, world: int, gpu: GPUProfile, fixed: Fixed, megart: bool = True
) -> list[Layout]:
    """Every layout within ``fixed`` that passes megart train's checks; ``megart``: the
    runtime is megart's (zero-bubble schedules, context parallelism searched, and its rank
    grid's rule on nodes of the profile's size), else Megatron-LM's."""
    heads = base.num_query_groups if base.group_query_attention else base.num_attention_heads
    # Searched tensor-parallel groups stay inside a node (t divides the node's GPUs).
    tps = [fixed.tp] if fixed.tp else [t for t in divisors(world) if gpu.gpus_per_node % t == 0]
    if base.num_experts and (fixed.tp or 1) > 1 and not fixed.sequence_parallel:
        # Left out, --sequence-parallel is searched, but megart train reads it as off and
        # refuses experts split without it: refused here in its words, as it would be.
        check_moe_tensor_parallel(base.gpt_config(), fixed.tp, False)
    cps = context_parallel_sizes(base, world, fixed, megart)
    out = []
    for t in tps:
        if fixed.tp is None and heads % t:
            continue
        for cp in cps:  # d = world / (t cp p)
            if fixed.cp is None and not _runs_context_parallel(base, t, cp):
                continue
            out += _layouts(base, world, gpu, fixed, megart, t, cp)
    return out


def _runs_context_parallel(base: TrainConfig, t: int, cp: int) -> bool:
    """Whether megart train's context-parallel checks accept a searched ``cp`` with tensor-
    parallel size ``t`` (sequence parallelism, searched apart, left out); multi-latent
    attention and multi-token prediction included (plan.mla_cp, plan.mtp_memory)."""
    probe = dataclasses.replace(
        base, tensor_model_parallel_size=t, context_parallel_size=cp, sequence_parallel=False
    )
    try:
        check_context_parallel(probe)  # MoE layers under cp: planned
    except ConfigError:
        return False
    return True


def _layouts(
    base: TrainConfig, world: int, gpu: GPUProfile, fixed: Fixed, megart: bool, t: int, cp: int
) -> list[Layout]:
    """candidates() of tensor-parallel size ``t`` and context-parallel size ``cp``."""
    searched_cp = cp > 1 and fixed.cp is None
    # Sequence parallelism splits each rank's s/cp tokens over t (megart train refuses else).
    sp_fits = (base.seq_length // cp) % t == 0
    if searched_cp and fixed.sequence_parallel and not sp_fits:
        return []
    tc = t * cp
    pps = [fixed.pp] if fixed.pp else divisors(world // tc) if world % tc == 0 else []
    out = []
    for p in pps:
        if world % (tc * p):
            continue
        if fixed.pp is None and base.num_layers % p:
            continue
        d = world // (tc * p)
        if megart and _grid_refuses(world, t, p, gpu.gpus_per_node, cp):
            continue
        kinds = schedules(fixed, p, base.num_layers, megart)
        if base.num_experts:
            # zero-bubble schedules are not modelled with them (plan.flags)
            kinds = [(v, kind) for v, kind in kinds if kind not in ZERO_BUBBLE]
        bs = [fixed.micro_batch] if fixed.micro_batch else list(MICRO_BATCHES)
        if searched_cp and not fixed.micro_batch:
            bs = [1]  # b > 1 at C is dominated by b / 2 at C / 2 (the module's doc)
        bs = [b for b in bs if fixed.micro_batch or base.global_batch_size % (b * d) == 0]
        sps = (
            [fixed.sequence_parallel]
            if fixed.sequence_parallel is not None
            else ([False, True] if t > 1 and (sp_fits or not searched_cp) else [False])
        )
        if base.num_experts and t > 1:  # experts split over t need it (megart train's check)
            sps = [sp for sp in sps if sp]
        recs = RECOMPUTE if fixed.recompute is False else (fixed.recompute,)
        dos = (
            [fixed.distributed_optimizer]
            if fixed.distributed_optimizer is not None
            else ([False, True] if d * cp > 1 else [False])
        )
        eps = expert_parallel_sizes(base, fixed, t, cp, d)
        for (v, kind), b, sp, rec, do, ep in itertools.product(kinds, bs, sps, recs, dos, eps):
            m = base.global_batch_size // (b * d) if b * d else 0
            # Interleaved (a given --num-layers-per-virtual-pipeline-stage is, to megart
            # train, even at one chunk a rank): microbatches a multiple of the stages.
            interleaved = v > 1 or fixed.schedule == "interleaved"
            if kind is None and interleaved and (m == 0 or m % p):
                continue
            if kind == "zb-v" and m < 2 * p:
                continue
            out.append(Layout(t, p, d, v, b, sp, rec, do, kind, fixed.first, fixed.last, cp,
                              chunks_by_count=fixed.chunks_by_count, ep=ep))  # fmt: skip
    return out


def expert_parallel_sizes(base: TrainConfig, fixed: Fixed, t: int, cp: int, d: int) -> list[int]:
    """The expert-parallel sizes to try with ``t``, ``cp`` and ``d`` data-parallel ranks: the
    one given; else for an MoE model each divisor of d x cp (the ranks an expert-parallel
    group spans, of one tensor-parallel rank) that divides --num-experts (megart train's
    check_expert_parallel), else 1."""
    if fixed.ep is not None:
        return [fixed.ep]
    if not base.num_experts:
        return [1]
    return [e for e in divisors(d * cp) if base.num_experts % e == 0]


def _grid_refuses(world: int, t: int, p: int, gpus_per_node: int, cp: int = 1) -> bool:
    """Whether megart's rank grid refuses (t, p, cp) on nodes of ``gpus_per_node`` GPUs: a
    pipeline hop between nodes that changes rail (GridLayout's rule; Megatron-LM has no such
    rule)."""
    try:
        make_layout(world, t, p, gpus_per_node=gpus_per_node, cp=cp)
    except ConfigError:
        return True
    return False
