"""megart plan's time under context parallelism (--context-parallel-size C): each rank's
attention core (one C-th of the causal scores), the key/value all-gathers and reduce-scatters
over NVLink or the rails, sequence parallelism's collectives on each rank's s/C tokens, the
gradients and the distributed optimizer over d x C, and the ring's (--cp-comm-type p2p) passes
of keys and values and its flash blocks against the all-gather's. Memory against real ranks,
C = 1, monotony and refusals: test_plan_context_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest

from megart.models.config import GPTConfig
from megart.plan.collectives import collective_seconds
from megart.plan.context_parallel import ring_passes
from megart.plan.data_parallel import data_parallel_bus_gb_per_s
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout
from megart.plan.timing import layer_work, ring_seconds
from megart.training.config import TrainConfig
from test_plan_memory import SMALL

GPU = load_profile("a100-80gb")
H100 = load_profile("h100-80gb")

LONG = GPTConfig(
    num_layers=4, hidden_size=2048, num_attention_heads=16, seq_length=8192, vocab_size=32000,
    cp_comm_type="all_gather",
)  # fmt: skip
RING = dataclasses.replace(LONG, cp_comm_type="p2p")


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_runs_one_cth_of_the_causal_scores(cp):
    """Each of a rank's two query chunks meets the keys up to its own end, causal: with C
    sequences per microbatch a rank runs one process's dense work at one sequence, and its
    causal half of the s x s scores, once the K/V all-gathers are set aside."""
    one = layer_work(LONG, 1, 1, False, None, H100)
    split = layer_work(LONG, cp, 1, False, None, H100, cp=cp)
    assert split.weight == one.weight  # the dense products: the same tokens
    gather = split.cp_comm / 2  # forward: two all-gathers of the same size as backward's
    assert split.forward - gather == pytest.approx(one.forward, rel=1e-12)


@pytest.mark.parametrize(
    "tp,cp,rails", [(1, 2, 0), (2, 4, 0), (4, 2, 0), (8, 2, 1), (4, 4, 2), (1, 16, 8)]
)
def test_keys_and_values_are_gathered_over_nvlink_or_the_rails(tp, cp, rails):
    """Two all-gathers (K, V: b s kv/t 16-bit elements each, gathered) forward and two
    reduce-scatters backward per layer, over NVLink while the t x C ranks fit in a node, else
    over the rails the group has in each node (its members sit t apart)."""
    w = layer_work(LONG, 1, tp, False, None, GPU, cp=cp,
                   cp_bus_gb_per_s=data_parallel_bus_gb_per_s(GPU, tp, cp))  # fmt: skip
    bus = rails * GPU.rail_gb_per_s if rails else GPU.nvlink_bus_gb_per_s
    kv = LONG.seq_length * LONG.hidden_size / tp * 2
    one = collective_seconds("all_gather", kv, cp, bus, GPU)
    one += collective_seconds("reduce_scatter", kv, cp, bus, GPU)
    assert w.cp_comm == pytest.approx(2 * one, rel=1e-12)
    full = layer_work(LONG, 1, tp, False, "full", GPU, cp=cp,
                      cp_bus_gb_per_s=data_parallel_bus_gb_per_s(GPU, tp, cp))  # fmt: skip
    assert full.cp_comm == pytest.approx(w.cp_comm + w.cp_comm / 2, rel=1e-12)  # regathered
    # Selective recomputation's checkpoint starts after the all-gathers: none replayed.
    selective = layer_work(LONG, 1, tp, False, "selective", GPU, cp=cp,
                           cp_bus_gb_per_s=data_parallel_bus_gb_per_s(GPU, tp, cp))  # fmt: skip
    assert selective.cp_comm == w.cp_comm


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallel_collectives_under_cp_run_on_each_ranks_tokens(tp):
    """With sequence parallelism each all-reduce is a reduce-scatter and an all-gather of the
    rank's s/C tokens (b s h / C 16-bit elements), two per pass; the element-wise work splits
    over t; the keys' and values' collectives over the cp group stay as without it."""
    cp = 2
    sp = layer_work(LONG, 1, tp, True, None, H100, cp=cp)
    plain = layer_work(LONG, 1, tp, False, None, H100, cp=cp)
    nbytes = LONG.seq_length // cp * LONG.hidden_size * 2
    one = sum(collective_seconds(k, nbytes, tp, H100.nvlink_bus_gb_per_s, H100)
              for k in ("reduce_scatter", "all_gather"))  # fmt: skip
    assert sp.tp_comm == pytest.approx(2 * 2 * one, rel=1e-12)
    assert sp.cp_comm == plain.cp_comm > 0
    assert sp.weight == plain.weight
    # Forward: the same products and K/V gathers; the norms' and residuals' 10 h bytes per
    # token (16-bit) over t, and the tensor-parallel collectives in place of the all-reduces.
    elem = (
        LONG.seq_length // cp * 10 * LONG.hidden_size * 2 * (1 - 1 / tp) / (H100.hbm_gb_per_s * 1e9)
    )
    assert plain.forward - sp.forward == pytest.approx(
        elem + (plain.tp_comm - sp.tp_comm) / 2, rel=1e-9
    )


def test_gradients_and_the_distributed_optimizer_span_d_x_cp():
    """cp 2 x d 4 shares gradients and optimizer state over 8 ranks as d 8 does: the same
    optimizer bytes per rank, Adam time and gradient all-gather time."""
    base = TrainConfig(**dict(SMALL, seq_length=2048, hidden_size=1024, num_attention_heads=16,
                              global_batch_size=32, bf16=True))  # fmt: skip
    d8 = Layout(1, 1, 8, 1, 1, False, None, True)
    cp2 = dataclasses.replace(d8, dp=4, cp=2)
    a, b = estimate(base, d8, GPU), estimate(base, cp2, GPU)
    assert b.memory["optimizer"] == a.memory["optimizer"]
    assert b.time["optimizer"] == a.time["optimizer"]
    assert b.memory["parameters"] == a.memory["parameters"]
    assert b.time["cp_comm"] > 0 == a.time["cp_comm"]


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 4), (8, 2)])
def test_the_ring_passes_keys_and_values_cp_minus_1_times_and_their_gradients_back(tp, cp):
    """Under the ring a layer's exchange is cp - 1 steps forward of the rank's K and V (2 b
    s/C kv/t 16-bit elements) to the next rank, and cp - 1 such steps and C of their fp32
    gradients backward, one latency each, counted whole (the overlap is unmeasured); the
    forward's steps again under full and under selective recomputation (the ring runs inside
    selective's checkpoint; counted on real steps: test_plan_cp_exchanges.py). Its blocks:
    flash kernels (test below)."""
    bus = data_parallel_bus_gb_per_s(GPU, tp, cp)
    w = layer_work(RING, 1, tp, False, None, GPU, cp=cp, cp_bus_gb_per_s=bus)
    kv = 2 * RING.seq_length // cp * RING.hidden_size / tp * 2
    latency = GPU.link_latency_us * 1e-6
    forward = (cp - 1) * (kv / (bus * 1e9) + latency)
    backward = forward + cp * (2 * kv / (bus * 1e9) + latency)
    assert w.cp_comm == pytest.approx(forward + backward, rel=1e-12)
    for rec in ("full", "selective"):
        again = layer_work(RING, 1, tp, False, rec, GPU, cp=cp, cp_bus_gb_per_s=bus)
        assert again.cp_comm == pytest.approx(w.cp_comm + forward, rel=1e-12), rec
    assert w.weight == layer_work(LONG, 1, tp, False, None, GPU, cp=cp).weight


@pytest.mark.parametrize("tp,cp,rec", [(1, 2, None), (2, 4, "selective"), (8, 2, "full")])
def test_the_rings_blocks_compute_what_the_all_gathers_flash_attention_does(tp, cp, rec):
    """The ring runs its blocks with flash kernels: the same causal FLOPs (1/C of one
    process's causal scores per rank) at the same efficiency, flash's backward, no scores in
    memory; so with the exchanges set aside a ring layer costs what an all-gather layer does,
    forward, backward and recomputed."""
    ring = layer_work(RING, 2, tp, False, rec, GPU, cp=cp)
    gather = layer_work(LONG, 2, tp, False, rec, GPU, cp=cp)
    passes = ring_passes(RING, 2, tp, cp, rec)
    fwd_ring, bwd_ring, again = ring_seconds(passes, GPU.nvlink_bus_gb_per_s, GPU)
    assert passes.replayed == (cp - 1 if rec else 0)  # either recomputation replays the ring
    fwd_gather = gather.cp_comm / (3 if rec == "full" else 2)  # two all-gathers, as backward's
    assert ring.forward - fwd_ring == pytest.approx(gather.forward - fwd_gather, rel=1e-12)
    assert ring.backward - bwd_ring - again == pytest.approx(
        gather.backward - (gather.cp_comm - fwd_gather), rel=1e-12
    )
    assert ring.weight == gather.weight
