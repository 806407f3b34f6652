"""megart plan searching context parallelism (--context-parallel-size left out): only the sizes
megart train runs, its ranks where megart's grid puts them, never a slower recommendation than
with C = 1 given, a sequence too long for every C = 1 layout planned with C > 1, each searched
layout predicted as the cp-aware model predicts it given, and the two shortcuts the search takes
(work_bound, micro-batch 1 at C > 1, peaks over distinct holdings) sound."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megart import schedule as sched
from megart.errors import ConfigError
from megart.parallel.layout import make_layout
from megart.plan.data_parallel import data_parallel_bus_gb_per_s
from megart.plan.estimate import estimate, work_bound
from megart.plan.hardware import GIB, load_profile
from megart.plan.holding import Held, peaks
from megart.plan.layout import layout_config
from megart.plan.search import Fixed, NoFit, candidates, search
from megart.training.config import TrainConfig
from plan_workers import plan_json

H100 = load_profile("h100-80gb")


def _model(seq: int, batch: int, **kw: object) -> TrainConfig:
    return TrainConfig(num_layers=4, hidden_size=1024, num_attention_heads=8, seq_length=seq,
                       vocab_size=32000, global_batch_size=batch, bf16=True, **kw)  # fmt: skip


# --- which sizes --------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    seq=st.sampled_from([96, 1000, 1024, 3072, 4096, 32768]),
    world=st.sampled_from([4, 8, 16, 24, 32]),
    sp=st.sampled_from([None, True, False]),
    comm=st.sampled_from(["all_gather", "p2p"]),
)
def test_context_parallelism_is_searched_only_where_megart_train_runs_it(seq, world, sp, comm):
    """Every power of two C with s divisible by 2 C and C dividing the GPUs is tried (at t = 1,
    p = 1 each has a layout: the batch is the GPUs' count), none other; each layout passes
    megart train's checks (sequence parallelism only where t divides s/C); b = 1 at C > 1."""
    base = _model(seq, world, cp_comm_type=comm)
    layouts = candidates(base, world, H100, Fixed(sequence_parallel=sp))
    powers = [2**k for k in range(world.bit_length())]
    want = {c for c in powers if world % c == 0 and seq % (2 * c) == 0}
    assert {x.cp for x in layouts} == want
    for x in layouts:
        assert x.world == world
        layout_config(base, x).check(world)  # megart train's checks, cp's included
        if x.cp > 1:
            assert x.micro_batch == 1
            assert not x.sequence_parallel or (seq // x.cp) % x.tp == 0


def test_given_megatrons_runtime_context_parallelism_is_not_searched():
    """The planner models megart's all-gather, ring and all-to-all: 1 alone under --runtime
    megatron, every C under --cp-comm-type a2a whose t x C divides the 8 heads (tests/
    test_plan_a2a.py), and the size given alone."""
    base = _model(4096, 8)
    assert {x.cp for x in candidates(base, 8, H100, Fixed())} == {1, 2, 4, 8}
    assert {x.cp for x in candidates(base, 8, H100, Fixed(), megart=False)} == {1}
    a2a = dataclasses.replace(base, cp_comm_type="a2a")
    assert {x.cp for x in candidates(a2a, 8, H100, Fixed())} == {1, 2, 4, 8}
    assert {(x.tp, x.cp) for x in candidates(a2a, 8, H100, Fixed()) if x.tp == 4} == {
        (4, 1),
        (4, 2),
    }
    assert {x.cp for x in candidates(base, 8, H100, Fixed(cp=2))} == {2}
    assert {x.cp for x in candidates(base, 8, H100, Fixed(cp=1))} == {1}


@settings(max_examples=40, deadline=None)
@given(
    world=st.sampled_from([8, 16, 32, 64, 128]),
    tp=st.sampled_from([1, 2, 4, 8]),
    cp=st.sampled_from([2, 4, 8, 16]),
    pp=st.sampled_from([1, 2, 4]),
)
def test_the_context_parallel_groups_links_are_those_of_megarts_rank_grid(world, tp, cp, pp):
    """The plan times the cp group's exchanges, and the gradients' reduction over d x C, over
    the links of a group whose members sit t apart (data_parallel_bus_gb_per_s): NVLink inside
    one node, else as many rails as the group has GPUs in a node. Checked against the groups
    megart's rank grid (tp-cp-dp-pp) builds, on nodes of 8."""
    assume(world % (tp * cp * pp) == 0)
    try:
        grid = make_layout(world, tp, pp, gpus_per_node=8, cp=cp)
    except ConfigError:
        assume(False)
    for kind, size in (("cp", cp), ("dp_cp", cp * grid.dp)):
        members = grid.group_of(kind, 0)
        assert members is not None and len(members) == size
        per_node = Counter(r // 8 for r in members)
        if len(per_node) == 1:
            links = H100.nvlink_bus_gb_per_s
        else:
            links = min(max(per_node.values()) * H100.rail_gb_per_s, H100.nvlink_bus_gb_per_s)
        assert data_parallel_bus_gb_per_s(H100, tp, size) == links, (kind, members)


# --- what the search finds ----------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    seq=st.sampled_from([2048, 8192, 32768, 65536]),
    world=st.sampled_from([8, 16]),
    hidden=st.sampled_from([1024, 2048]),
    comm=st.sampled_from(["all_gather", "p2p", "a2a"]),
    batch=st.sampled_from([1, 4, 16]),
)
def test_searched_context_parallelism_is_never_slower_and_predicted_as_given(
    seq, world, hidden, comm, batch
):
    """The recommendation with C left out is never slower than with C = 1 given, and fits
    where that fits; every searched layout with C > 1 is predicted exactly as estimate()
    predicts it with that C given (memory by part and time by part: the cp-aware model that
    test_plan_context_parallel checks against real ranks)."""
    base = dataclasses.replace(
        _model(seq, batch * world // 8, cp_comm_type=comm),
        hidden_size=hidden,
        num_attention_heads=hidden // 128,
    )
    try:
        one = search(base, world, H100, Fixed(cp=1), keep=8)
    except NoFit:
        one = None
    except ConfigError:
        assume(False)
    try:
        found = search(base, world, H100, Fixed(), keep=8)
    except NoFit:
        assert one is None  # where C = 1 fits, the search fits
        return
    if one is not None:
        assert found[0].iteration_time <= one[0].iteration_time
    for e in found:
        if e.layout.cp > 1:
            again = estimate(base, e.layout, H100)
            assert again.memory == e.memory and again.time == e.time, e.layout.short()


# A 2-layer GPT of a million-token sequence on 32 H100s (4 nodes). With C = 1 no layout fits:
# each rank holds every token of its sequence, t is at most 8 (a node, and the 8 heads), p
# splits layers and d batches, neither the sequence: the output layer's saves alone (its
# logits in fp32 over s tokens and 128256 / t vocabulary entries) are 65 GiB at t = 8, and
# every layout needs more than the 71.4 usable. With C > 1 each rank holds s/C tokens.
MILLION = TrainConfig(num_layers=2, hidden_size=1024, num_attention_heads=8, seq_length=2**20,
                      vocab_size=128256, untie_embeddings_and_output_weights=True,
                      global_batch_size=4, bf16=True)  # fmt: skip
MILLION_ARGV = (
    "--gpu h100-80gb --num-gpus 32 --num-layers 2 --hidden-size 1024 --num-attention-heads 8 "
    "--seq-length 1048576 --vocab-size 128256 --untie-embeddings-and-output-weights "
    "--global-batch-size 4"
)


def test_a_sequence_too_long_for_every_layout_without_context_parallelism_fits_with_it():
    with pytest.raises(NoFit) as nowhere:
        search(MILLION, 32, H100, Fixed(cp=1))
    assert nowhere.value.estimates[0].memory["total"] > H100.usable_bytes
    found = search(MILLION, 32, H100, Fixed())
    best = found[0]
    assert best.fits and best.layout.cp > 1
    assert best.memory["total"] <= H100.usable_bytes
    # What the cp-aware model predicts with that C given.
    given_cp = search(MILLION, 32, H100, Fixed(cp=best.layout.cp))[0]
    assert given_cp.layout == best.layout and given_cp.memory == best.memory


def test_plan_names_the_searched_context_parallel_size(capsys):
    out = plan_json(MILLION_ARGV, capsys)
    cp = out["layout"]["cp"]
    assert cp > 1 and out["fits"]
    assert f"--context-parallel-size {cp}" in out["layout"]["flags"]
    assert out["memory_gib"]["total"] <= H100.usable_bytes / GIB
    from megart.cli.plan import main as plan_main

    assert plan_main(MILLION_ARGV.split()) == 0
    text = capsys.readouterr().out
    assert f"recommended: megart train --tensor-model-parallel-size {out['layout']['tp']} " \
        f"--context-parallel-size {cp} " in text  # fmt: skip
    # Given, C is not searched: C = 1 fits nowhere, as megart plan says.
    assert plan_main((MILLION_ARGV + " --context-parallel-size 1").split()) == 2
    assert "no layout fits" in capsys.readouterr().err


# --- the search's shortcuts ---------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    seq=st.sampled_from([1024, 8192, 32768]),
    world=st.sampled_from([8, 16]),
    comm=st.sampled_from(["all_gather", "p2p"]),
    pick=st.randoms(use_true_random=False),
)
def test_work_bound_never_exceeds_the_estimate(seq, world, comm, pick):
    """What the search skips on: the busiest rank's forward and backward alone, never more
    than the iteration estimate() predicts, quick or simulated (zero-bubble, interleaved,
    uneven stages included)."""
    base = _model(seq, 4 * world, cp_comm_type=comm)
    fixed = Fixed(first=pick.choice([None, 1])) if pick.random() < 0.2 else Fixed()
    if fixed.first is not None:
        fixed = dataclasses.replace(fixed, pp=pick.choice([2, 4]), last=None)
    layouts = candidates(base, world, H100, fixed)
    for layout in pick.sample(layouts, min(12, len(layouts))):
        try:
            bound = work_bound(base, layout, H100)
        except ConfigError:
            continue
        for simulate in (False, True):
            e = estimate(base, layout, H100, simulate=simulate)
            assert 0 < bound <= e.iteration_time, layout.short()


@settings(max_examples=25, deadline=None)
@given(
    seq=st.sampled_from([2048, 8192, 32768]),
    tp=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([2, 4, 8]),
    pp=st.sampled_from([1, 2]),
    half=st.sampled_from([1, 2]),
    rec=st.sampled_from([None, "selective", "full"]),
    comm=st.sampled_from(["all_gather", "p2p", "a2a"]),
    rope=st.booleans(),
)
def test_micro_batch_2k_at_c_is_never_faster_than_k_at_half_c(
    seq, tp, cp, pp, half, rec, comm, rope
):
    """Why C > 1 is searched at b = 1 alone: b = 2k at C runs what b = k at C/2 runs (each
    rank's tokens, the microbatches, the d x C ranks of the gradients) with more exchange;
    its memory is no less but for per-microbatch tables of the rank's s/C rows (rope's cos and
    sin, learned positions' int64 index), which are not per sequence. (a2a: where t x C
    divides the 8 heads, as megart train requires; its memory against C/2 = 1, one process,
    is not compared: see below.)"""
    assume(comm != "a2a" or 8 % (tp * cp) == 0)
    pos = dict(position_embedding_type="rope") if rope else {}
    base = _model(seq, 8, cp_comm_type=comm, **pos)
    world = tp * cp * pp * 2
    layouts = []
    for c, b in ((cp, 2 * half), (cp // 2, half)):
        fixed = Fixed(tp=tp, pp=pp, cp=c, micro_batch=b, recompute=rec)
        layouts += [x for x in candidates(base, world, H100, fixed) if x.schedule is None]
    big = {(x.sequence_parallel, x.distributed_optimizer, x.chunks): x for x in layouts
           if x.cp == cp}  # fmt: skip
    for x in layouts:
        y = big.get((x.sequence_parallel, x.distributed_optimizer, x.chunks))
        if x.cp != cp // 2 or y is None:
            continue
        a, b = estimate(base, y, H100), estimate(base, x, H100)
        assert (a.microbatches, a.layout.dp * cp) == (b.microbatches, b.layout.dp * (cp // 2))
        assert a.iteration_time >= b.iteration_time * (1 - 1e-12)
        if comm == "a2a" and cp == 2:
            # One process against the all-to-all: with rope it keeps the fused q/k/v output
            # (v is a view of it) and rope's q and k, 7 h per token, where a2a's attention
            # keeps the exchanged q, k and v, 5 h (activations.a2a_attention_elements): less
            # at b = 2k, C = 2 than at k, C = 1, and less again at b = 1, C = 2, searched.
            continue
        rows = seq // (cp // 2) * (base.gpt_config().rotary_dim * 4 + 8)
        assert a.memory["total"] >= b.memory["total"] - max(b.peak_in_flight) * rows


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["1f1b", "interleaved", "zb-h1", "zb-v"]),
    p=st.sampled_from([2, 3, 4]),
    m=st.sampled_from([4, 8, 12]),
    costs=st.lists(st.integers(0, 1000), min_size=9, max_size=9),
)
def test_peaks_over_distinct_holdings_are_those_of_the_whole_compute_order(kind, p, m, costs):
    """peaks() walks each rank's distinct holdings once (what makes the search's zero-bubble
    layouts cheap): the same holdings as a walk of every compute, by hand here."""
    v = {"interleaved": 2, "zb-v": 2}.get(kind, 1)
    assume(kind != "interleaved" or m % p == 0)
    assume(kind != "zb-v" or m >= 2 * p)
    schedule = sched.build(kind, p, m, v)
    per_pair = [costs[0] + r for r in range(p)]
    grads = [[costs[1 + (r + k) % 8] for k in range(v)] for r in range(p)]
    last = p * v - 1
    for rank, actions in enumerate(schedule.ranks):
        acts, by_chunk, last_grads, best, top = 0, [0] * v, 0, Held(0), -1
        for a in actions:
            if a.op not in ("F", "B", "I", "W"):
                continue
            acts += {"F": 1, "B": -1, "I": -1, "W": 0}[a.op]
            step = {"I": 1, "W": -1}.get(a.op, 0)
            by_chunk[a.chunk] += step
            last_grads += step * (schedule.virtual_stage(rank, a.chunk) == last)
            pairs = zip(by_chunk, grads[rank], strict=True)
            held = acts * per_pair[rank] + sum(n * w for n, w in pairs)
            if held > top or (held == top and acts + sum(by_chunk) > best.in_flight):
                best, top = Held(acts, sum(by_chunk), last_grads), held
        assert peaks(schedule, per_pair, grads)[rank] == best
