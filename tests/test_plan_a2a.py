"""megart plan under context parallelism's all-to-all (--cp-comm-type a2a): the all-to-alls a
real megart train step posts (how many, of which buffers, the bytes each rank's transport
sent) and the saved activations a real rank holds (torch's saved-tensor hooks) against the
plan's counts; the exchanges' time over the links of megart's rank grid; attention over the
whole sequence on heads/(t C) heads as one process runs it; the search trying only the C that
megart train accepts; explicit C estimated, invalid C refused in megart train's words."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.cli.plan import main as plan_main
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.parallel.layout import make_layout
from megart.plan.context_parallel import a2a_exchanges, a2a_seconds
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout, layout_config
from megart.plan.memory import rank_memory
from megart.plan.search import Fixed, candidates
from megart.plan.timing import ACT, layer_work
from megart.training.config import TrainConfig
from plan_exchange_workers import a2a_traffic
from plan_workers import held_bytes, plan_json
from test_plan_memory import LLAMA, SMALL, _layout

GPU = load_profile("a100-80gb")
A2A = dict(cp_comm_type="a2a")

# --- a real rank's exchanges and saves ----------------------------------------------------

# (world, name, model, layout flags). SMALL: 4 heads; LLAMA: 4 heads in 2 query groups, RMSNorm,
# SwiGLU. bf16 cases at 96 tokens per microbatch: no weight's shape (plan_workers.SavedBytes).
CASES = [
    (2, "cp2", SMALL, dict(A2A, context_parallel_size=2, micro_batch_size=2)),
    (
        2,
        "cp2 llama-style selective bf16",
        dict(LLAMA, seq_length=96),
        dict(
            A2A,
            context_parallel_size=2,
            recompute_granularity="selective",
            bf16=True,
            micro_batch_size=1,
        ),
    ),  # fmt: skip
    (
        4,
        "cp2 x tp2 sequence parallel",
        SMALL,
        dict(
            A2A,
            context_parallel_size=2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            micro_batch_size=2,
        ),
    ),  # fmt: skip
    (
        4,
        "cp4 full recomputation",
        SMALL,
        dict(A2A, context_parallel_size=4, recompute_granularity="full", micro_batch_size=2),
    ),
    (
        4,
        "cp2 x dp2 llama-style rope bf16 distributed optimizer",
        dict(LLAMA, seq_length=96, position_embedding_type="rope", global_batch_size=4),
        dict(
            A2A,
            context_parallel_size=2,
            use_distributed_optimizer=True,
            bf16=True,
            micro_batch_size=1,
        ),
    ),  # fmt: skip
]


def measured_in_turn(runs: list[dict]) -> list[dict]:
    """For each config in turn on this rank: what it holds (plan_workers.held_bytes), its
    context-parallel rank, and one step's all-to-alls (plan_exchange_workers.a2a_traffic)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = []
    for kw in runs:
        c = TrainConfig(**kw)
        grid = make_layout(world, c.tp, c.pp, cp=c.context_parallel_size)
        out.append({**held_bytes(kw), **a2a_traffic(kw), "cp_rank": grid.cp_rank_of(rank)})
    return out


@pytest.fixture(scope="module")
def measured() -> list[list[dict]]:
    """Per case of CASES, what each of its ranks measured (one launch per world size)."""
    by_case: dict[int, list[dict]] = {}
    for world in (2, 4):
        index = [i for i, case in enumerate(CASES) if case[0] == world]
        runs = [{**CASES[i][2], **CASES[i][3]} for i in index]
        per_rank = launch(measured_in_turn, world, runs, timeout=600)
        for i, ranks in zip(index, zip(*per_rank, strict=True), strict=True):
            by_case[i] = list(ranks)
    return [by_case[i] for i in range(len(CASES))]


IDS = [c[1] for c in CASES]


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_the_planned_all_to_alls_are_those_a_real_step_posts(case, measured):
    """Per layer and microbatch four all-to-alls forward (q, k, v: b s/C heads/t d and b s/C
    groups/t d elements; the output, q's size), four backward, and replayed the four under full
    recomputation, q's, k's and v's under selective (torch's checkpoint stops replaying at the
    kernel's saves, before the output's exchange): the same buffers, and each rank sends
    (C - 1)/C of each, 1/C to each peer of its cp group, 16-bit under bf16 as the plan's time
    counts them."""
    world, name, model, flags = CASES[case]
    config = TrainConfig(**model, **flags)
    cfg, layout = config.gpt_config(), _layout(config, world)
    cp = layout.cp
    per_layer = a2a_exchanges(cfg, layout.micro_batch, layout.tp, cp, layout.recompute).all
    layers = cfg.num_layers // layout.pp * config.microbatches(layout.dp)
    want = Counter({n: k * layers for n, k in Counter(per_layer).items()})
    for rank in measured[case]:
        assert Counter(n for n, _ in rank["calls"]) == want, (name, rank["calls"])
        sizes = {size for _, size in rank["calls"]}
        assert sizes == {ACT if config.bf16 else 4}
        me = rank["cp_ranks"][rank["cp_rank"]]
        peers = set(rank["cp_ranks"]) - {me}
        each = sum(per_layer) * layers * sizes.pop() / cp
        assert rank["sent"] == {p: pytest.approx(each, rel=1e-12) for p in peers}, name


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_predicted_bytes_are_what_an_all_to_all_rank_holds(case, measured):
    """Parameters, gradients and optimizer state to the byte; saved activations to the byte
    in fp32 (16-bit: within the uncounted casts of norm weights and biases, 1%): per own token
    the exchanged q, k and v (heads/(t C) of the whole sequence), flash attention's output and
    the projection's copy of it, no other rank's keys and values beyond those."""
    world, name, model, flags = CASES[case]
    config = TrainConfig(**model, **flags)
    layout = _layout(config, world)
    plan = estimate(config, layout, GPU)
    c = layout_config(config, layout)
    for rank in measured[case]:
        r = rank["pp_rank"]
        shard = rank["dp_rank"] * layout.cp + rank["cp_rank"]
        want = rank_memory(c, layout, layout.dp, r, plan.peak_in_flight[r], dp_rank=shard)
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == rank[part], (name, part)
        rel = 0.01 if config.bf16 else 0.0
        assert rank["saved_peak"] == pytest.approx(want["saved"], rel=rel), (name, rank)
        assert rank["saved_after"] == 0


# --- time ---------------------------------------------------------------------------------

# 32 heads in 16 query groups: q's exchanges twice k's and v's.
LONG = GPTConfig(num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=16,
                 seq_length=8192, vocab_size=32000, cp_comm_type="a2a")  # fmt: skip


@pytest.mark.parametrize("rec", [None, "selective", "full"])
@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 4), (1, 8), (8, 2), (4, 4), (1, 16)])
def test_the_all_to_alls_cross_the_links_of_megarts_rank_grid(tp, cp, rec):
    """Each all-to-all sends 1/C of the rank's buffer to every other rank of its cp group,
    all at once: to those in its node over NVLink, to the others over its own rail, the
    slower of the two plus one latency. The group's members are those megart's rank grid
    (tp-cp-dp-pp, nodes of 8) puts in it."""
    cfg = LONG
    members = make_layout(8 * 16, tp, 1, gpus_per_node=8, cp=cp).group_of("cp", 0)
    assert members is not None
    near = Counter(r // 8 for r in members)[0]

    def one(nbytes: float) -> float:
        inside = (near - 1) * nbytes / cp / (GPU.nvlink_bus_gb_per_s * 1e9)
        across = (cp - near) * nbytes / cp / (GPU.rail_gb_per_s * 1e9)
        return max(inside, across) + GPU.link_latency_us * 1e-6

    tokens = cfg.seq_length // cp
    q = tokens * cfg.hidden_size / tp * 2
    kv = tokens * cfg.query_groups * cfg.head_dim / tp * 2
    # Forward and backward; full recomputation replays the four, selective q's, k's and v's.
    again = {None: 0.0, "full": 2 * one(q) + 2 * one(kv), "selective": one(q) + 2 * one(kv)}
    w = layer_work(cfg, 1, tp, False, rec, GPU, cp=cp)
    assert w.cp_comm == pytest.approx(2 * (2 * one(q) + 2 * one(kv)) + again[rec], rel=1e-12)


@pytest.mark.parametrize("unfused", [False, True])
@pytest.mark.parametrize("rec", [None, "selective", "full"])
@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 4), (1, 8), (4, 2)])
def test_each_rank_attends_over_the_sequence_with_heads_over_t_x_c(tp, cp, rec, unfused):
    """With C sequences per microbatch a rank runs one process's work at one sequence: the
    dense products on the same tokens, and attention over the whole sequence on heads/(t C) of
    the heads for C sequences (flash: the causal half; unfused: torch's math kernel, all the
    products and the scores' bytes), once the all-to-alls are set aside."""
    one = layer_work(LONG, 1, tp, False, rec, GPU, unfused)
    split = layer_work(LONG, cp, tp, False, rec, GPU, unfused, cp=cp)
    ex = a2a_exchanges(LONG, cp, tp, cp, rec)

    def seconds(sizes: tuple[float, ...]) -> float:
        return sum(a2a_seconds(n * ACT, cp, tp, GPU) for n in sizes)

    forward, backward = seconds(ex.forward), seconds(ex.backward) + seconds(ex.replayed)
    assert split.forward - forward == pytest.approx(one.forward, rel=1e-12)
    assert split.backward - backward == pytest.approx(one.backward, rel=1e-12)
    assert split.weight == one.weight


@settings(max_examples=40, deadline=None)
@given(
    nbytes=st.floats(1e3, 1e10),
    more=st.floats(1.01, 100),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    cp=st.sampled_from([2, 4, 8, 16]),
)
def test_an_all_to_all_takes_longer_with_more_bytes_and_over_the_rails(nbytes, more, tp, cp):
    """More bytes never less time; a group that leaves its node never faster than the same
    group inside one node (NVLink feeds more than a rail)."""
    t = a2a_seconds(nbytes, cp, tp, GPU)
    assert 0 < t < a2a_seconds(nbytes * more, cp, tp, GPU)
    one_node = dataclasses.replace(GPU, gpus_per_node=256)
    assert a2a_seconds(nbytes, cp, tp, one_node) <= t


@settings(max_examples=25, deadline=None)
@given(
    seq=st.sampled_from([512, 4096, 32768]),
    groups=st.sampled_from([None, 8]),
    rec=st.sampled_from([None, "selective", "full"]),
    tp=st.sampled_from([1, 2]),
    bf16=st.booleans(),
)
def test_more_all_to_all_ranks_hold_less_and_differ_from_the_ring(seq, groups, rec, tp, bf16):
    """Every activation term of a2a is per own token (none of another rank's keys and values
    is kept past the exchange): each doubling of C holds less. The ring's prediction at the
    same layout differs (its exchanges, what it keeps) and both are finite."""
    base = TrainConfig(num_layers=4, hidden_size=2048, num_attention_heads=16, seq_length=seq,
                       vocab_size=1000, global_batch_size=2, bf16=bf16, cp_comm_type="a2a",
                       **(dict(group_query_attention=True, num_query_groups=groups)
                          if groups else {}))  # fmt: skip
    held = []
    for cp in (1, 2, 4):
        layout = Layout(tp, 1, 1, 1, 1, False, rec, False, cp=cp)
        e = estimate(base, layout, GPU, simulate=False)
        for x in (*e.time.values(), *e.memory.values()):
            assert math.isfinite(x) and x >= 0
        held.append(e.memory["activations"])
        if cp > 1:
            ring = estimate(dataclasses.replace(base, cp_comm_type="p2p"), layout, GPU)
            assert math.isfinite(ring.iteration_time)
            assert ring.time["cp_comm"] != e.time["cp_comm"]
            assert ring.iteration_time != e.iteration_time
    assert held == sorted(held, reverse=True) and held[-1] < held[0]


# --- search and refusals ------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    world=st.sampled_from([8, 16, 32]),
    heads=st.sampled_from([8, 12, 16, 32]),
    per_group=st.sampled_from([1, 2, 4]),
    seq=st.sampled_from([96, 1024, 4096]),
)
def test_all_to_all_sizes_are_searched_where_megart_train_runs_them(world, heads, per_group, seq):
    """With C left out each (t, C) is tried whose t x C divides the GPUs, the heads and the
    query groups, and whose 2 C divides the sequence (C a power of two); every layout passes
    megart train's checks."""
    groups = heads // per_group
    gqa = dict(group_query_attention=True, num_query_groups=groups) if per_group > 1 else {}
    base = TrainConfig(num_layers=4, hidden_size=64 * heads, num_attention_heads=heads,
                       seq_length=seq, vocab_size=1000, global_batch_size=world,
                       **gqa, **A2A)  # fmt: skip
    layouts = candidates(base, world, GPU, Fixed())
    for x in layouts:
        layout_config(base, x).check(world)
    tps = [t for t in (1, 2, 4, 8) if world % t == 0 and groups % t == 0]
    want = {
        (t, c)
        for t in tps
        for c in (2**k for k in range(world.bit_length()))
        if world % (t * c) == 0 and seq % (2 * c) == 0 and groups % (t * c) == 0
    }
    assert {(x.tp, x.cp) for x in layouts} == want


ARGV = (
    "--gpu h100-80gb --num-gpus 8 --num-layers 4 --hidden-size 512 --num-attention-heads 8 "
    "--seq-length 1024 --vocab-size 1000 --global-batch-size 16 --cp-comm-type a2a"
)


def test_given_all_to_all_context_parallelism_is_planned(capsys):
    """--context-parallel-size 2 --cp-comm-type a2a is estimated (t x 2 dividing the 8 heads),
    and the search, C left out, tries C > 1."""
    out = plan_json(ARGV + " --context-parallel-size 2", capsys)
    assert "--context-parallel-size 2" in out["layout"]["flags"]
    assert {e["layout"]["cp"] for e in out["candidates"]} == {2}
    assert all(e["layout"]["tp"] in (1, 2, 4) for e in out["candidates"])
    searched = candidates(TrainConfig(num_layers=4, hidden_size=512, num_attention_heads=8,
                                      seq_length=1024, vocab_size=1000, global_batch_size=16,
                                      **A2A), 8, GPU, Fixed())  # fmt: skip
    assert {x.cp for x in searched} == {1, 2, 4, 8}


@pytest.mark.parametrize(
    "extra,train",
    [
        ("--context-parallel-size 8 --num-attention-heads 4",  # 4 heads over 8 ranks
         dict(context_parallel_size=8, num_attention_heads=4)),
        ("--context-parallel-size 2 --group-query-attention --num-query-groups 1",
         dict(context_parallel_size=2, group_query_attention=True, num_query_groups=1)),
    ],
)  # fmt: skip
def test_plan_refuses_an_all_to_all_megart_train_refuses_in_its_words(extra, train, capsys):
    assert plan_main((ARGV + " " + extra).split()) == 2
    err = capsys.readouterr().err
    model = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=1024,
                 vocab_size=1000, global_batch_size=16, **A2A)  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        TrainConfig(**{**model, **train}).check(8)
    assert f"megart plan: error: {refused.value}" in err
