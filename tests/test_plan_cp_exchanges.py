"""megart plan's context-parallel exchanges under the ring (--cp-comm-type p2p) and the
all-gather (all_gather) against those a real megart train step posts: per layer and microbatch
the ring's K/V passes forward, backward, replayed by recomputation (full and selective: the ring
runs inside selective's checkpoint) and its fp32 dK/dV passes, the bytes each rank sent its
next rank; the all-gather's K/V all-gathers, their reduce-scatters and the all-gathers replayed
(full only: selective's checkpoint starts after them). The all-to-all's: tests/test_plan_a2a.py."""

from __future__ import annotations

from collections import Counter

import pytest

from megart.launcher import launch
from megart.plan.context_parallel import kv_gathers, ring_passes
from megart.plan.timing import ACT, GRAD_BYTES
from megart.training.config import TrainConfig
from plan_exchange_workers import cp_traffic
from test_plan_memory import LLAMA, SMALL, _layout

RING, GATHER = dict(cp_comm_type="p2p"), dict(cp_comm_type="all_gather")
SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)
# bf16 at 96 tokens per microbatch: LLAMA-style (4 heads in 2 query groups), 16-bit K/V.
BF16 = dict(LLAMA, seq_length=96, bf16=True, micro_batch_size=1)


def _cases() -> list[tuple[int, str, dict]]:
    """(world, name, flags) for cp2 and cp4 under both exchanges and every recomputation, cp2 x
    tp2 with sequence parallelism, and bf16 (the bytes the plan's time counts)."""
    out = []
    for comm, name in ((RING, "p2p"), (GATHER, "all_gather")):
        for rec in (None, "selective", "full"):
            flags = dict(SMALL, **comm, recompute_granularity=rec, micro_batch_size=2)
            out.append((2, f"{name} cp2 {rec}", dict(flags, context_parallel_size=2)))
            out.append((4, f"{name} cp4 {rec}", dict(flags, context_parallel_size=4)))
        flags = dict(SMALL, **comm, **SP, context_parallel_size=2, micro_batch_size=2)
        out.append(
            (4, f"{name} cp2 x tp2 sp selective", dict(flags, recompute_granularity="selective"))
        )
        for rec in ("selective", "full"):
            bf16 = dict(BF16, **comm, context_parallel_size=2, recompute_granularity=rec)
            out.append((2, f"{name} cp2 bf16 llama-style {rec}", bf16))
    return out


CASES = _cases()


def traffic_in_turn(runs: list[dict]) -> list[dict]:
    return [cp_traffic(kw) for kw in runs]


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    """Per case of CASES, what each of its ranks counted (one launch per world size)."""
    by_case: dict[int, list[dict]] = {}
    for world in (2, 4):
        index = [i for i, case in enumerate(CASES) if case[0] == world]
        per_rank = launch(traffic_in_turn, world, [CASES[i][2] for i in index], timeout=900)
        for i, ranks in zip(index, zip(*per_rank, strict=True), strict=True):
            by_case[i] = list(ranks)
    return [by_case[i] for i in range(len(CASES))]


def _planned(config: TrainConfig, world: int) -> tuple[Counter, float]:
    """The plan's exchanges of one step on a rank, as the worker counts them, and the bytes the
    plan's time counts for its point-to-point messages (16-bit K/V, fp32 dK/dV)."""
    cfg, layout = config.gpt_config(), _layout(config, world)
    args = (cfg, layout.micro_batch, layout.tp, layout.cp, layout.recompute)
    layers = cfg.num_layers // layout.pp * config.microbatches(layout.dp)
    kv = ACT if config.bf16 else 4  # the element a real fp32 run sends
    want: Counter = Counter()
    nbytes = 0.0
    if cfg.cp_comm_type == "p2p":
        r = ring_passes(*args)
        want[("forward", "p2p", r.block, kv)] += r.forward * layers
        want[("backward", "p2p", r.block, kv)] += (r.backward + r.replayed) * layers
        want[("backward", "p2p", r.block, GRAD_BYTES)] += r.grads * layers
        nbytes = (
            layers * r.block * ((r.forward + r.backward + r.replayed) * ACT + r.grads * GRAD_BYTES)
        )
    else:
        g = kv_gathers(*args)
        for whole in (g.keys, g.values):
            part = whole / layout.cp  # the rank's own part of each gathered tensor
            want[("forward", "all_gather", part, kv)] += g.forward * layers
            want[("backward", "all_gather", part, kv)] += g.replayed * layers
            want[("backward", "reduce_scatter", part, kv)] += g.backward * layers
    return +want, nbytes


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[1] for c in CASES])
def test_the_planned_exchanges_are_those_a_real_step_posts(case, measured):
    """Every exchange of a real step, forward and in the backward (recomputation's replays
    included), of the plan's count and size; under the ring each rank sends only to its next
    rank, the bytes the plan's time counts (bf16: to the byte; fp32 runs send fp32 K/V, which
    the plan counts 16-bit)."""
    world, name, flags = CASES[case]
    config = TrainConfig(**flags)
    want, nbytes = _planned(config, world)
    for rank in measured[case]:
        assert Counter(tuple(c) for c in rank["calls"]) == want, (name, rank["calls"])
        if config.cp_comm_type != "p2p":
            assert rank["sent"] == {}
            continue
        ranks, me = rank["cp_ranks"], rank["cp_rank"]
        sent = sum(n * size * k for (_, _, n, size), k in want.items())
        assert rank["sent"] == {ranks[(me + 1) % len(ranks)]: sent}, name
        if config.bf16:
            assert sent == nbytes, name
