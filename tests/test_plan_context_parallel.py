"""megart plan with context parallelism (--context-parallel-size C given; searched when left out:
test_plan_cp_search.py):
each rank's parameter, gradient and optimizer bytes (the distributed optimizer sharded over
d x C) against real megart train ranks, its saved activations (s/C tokens of every layer, the
keys and values all-gathered over the whole sequence) against
torch's saved-tensor hooks; the attention core's and the key/value collectives' time; C = 1 as
no flag; more C never more activations; and megart train's refusals in its words."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.cli.plan import main as plan_main
from megart.errors import ConfigError
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.parallel.layout import make_layout
from megart.plan import activations as act
from megart.plan.context_parallel import ring_passes
from megart.plan.data_parallel import data_parallel_bus_gb_per_s
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout, layout_config
from megart.plan.memory import precision, rank_memory
from megart.plan.search import Fixed, candidates
from megart.plan.timing import collective_seconds, layer_work, ring_seconds
from megart.training.config import TrainConfig
from plan_workers import held_bytes, plan_json
from test_plan_memory import LLAMA, SMALL, _layout

GPU = load_profile("a100-80gb")
H100 = load_profile("h100-80gb")

# --- memory against real ranks ------------------------------------------------------------

TP2_CP2_SP = dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
# (name, model, layout flags), each on 4 ranks; one launch runs them all in turn.
CASES = [
    (
        "cp2 x tp2",
        SMALL,
        dict(context_parallel_size=2, tensor_model_parallel_size=2, micro_batch_size=2),
    ),
    # d = 1: the distributed optimizer shards over the two context-parallel ranks alone. 48
    # tokens per rank and microbatch: no weight's shape (see SavedBytes), and enough that the
    # uncounted 16-bit casts of norm weights and biases (O(h) per layer) stay under 1%.
    (
        "cp2 x pp2 bf16 distributed optimizer",
        dict(SMALL, seq_length=96),
        dict(
            context_parallel_size=2,
            pipeline_model_parallel_size=2,
            use_distributed_optimizer=True,
            bf16=True,
            micro_batch_size=1,
        ),
    ),
    # Sequence parallelism: each rank's s/C tokens split over t outside attention and the MLP
    # (norm inputs and statistics, the pipeline's and the embedding's outputs), the gathered
    # s/C saved where the column-parallel linears read them.
    (
        "cp2 x tp2 sequence parallel",
        SMALL,
        dict(TP2_CP2_SP, micro_batch_size=2),
    ),
    # GeLU: with SwiGLU and sequence parallelism megart's fc and gate each gather and keep the
    # MLP's input (h per token more than the plan counts, with or without cp; not cp's term).
    (
        "cp2 x tp2 sequence parallel llama-style (gelu) bf16",
        dict(LLAMA, seq_length=96, swiglu=False),
        dict(TP2_CP2_SP, bf16=True, micro_batch_size=1),
    ),
    (
        "cp2 x dp2 llama-style selective distributed optimizer",
        LLAMA,
        dict(
            context_parallel_size=2,
            use_distributed_optimizer=True,
            recompute_granularity="selective",
            micro_batch_size=2,
        ),
    ),
]
# The cases above run the ring (--cp-comm-type p2p, the default); these the all-gather.
GATHERED = dict(cp_comm_type="all_gather")
CASES += [
    (f"{name} all_gather", model, dict(flags, **GATHERED))
    for name, model, flags in CASES
    if name in ("cp2 x tp2", "cp2 x dp2 llama-style selective distributed optimizer")
]
# On 8 ranks: sequence parallelism's chunk outputs (1/t of the rank's s/C tokens), which the
# pipeline engine holds per microbatch in flight.
WIDE_CASES = [
    (
        "cp2 x tp2 x pp2 sequence parallel",
        SMALL,
        dict(TP2_CP2_SP, pipeline_model_parallel_size=2, micro_batch_size=1),
    ),
]
ALL_CASES = [(4, *c) for c in CASES] + [(8, *c) for c in WIDE_CASES]


def held_in_turn(runs: list[dict]) -> list[dict]:
    """plan_workers.held_bytes for each config in turn on this rank (one launch for all), with
    the rank's context-parallel rank (ranks tp-cp-dp-pp)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = []
    for kw in runs:
        c = TrainConfig(**kw)
        grid = make_layout(world, c.tp, c.pp, cp=c.context_parallel_size)
        out.append({**held_bytes(kw), "cp_rank": grid.cp_rank_of(rank)})
    return out


@pytest.fixture(scope="module")
def held() -> list[list[dict]]:
    """Per case of ALL_CASES, what each of its ranks held (one launch per world size)."""
    out = []
    for world, cases in ((4, CASES), (8, WIDE_CASES)):
        per_rank = launch(held_in_turn, world, [{**m, **f} for _, m, f in cases], timeout=300)
        out += [list(ranks) for ranks in zip(*per_rank, strict=True)]
    return out


def cpu_mask(config: TrainConfig, in_flight: int) -> float:
    """What a CPU rank keeps beyond the plan, which predicts a GPU (where each query chunk's
    causal bias is no tensor: models.context_parallel.blockwise_attention): the (s/C) x s
    additive mask of global positions of masked_attention, in the activations' dtype, made
    once (context_parallel.causal_bias) and kept by every layer and microbatch in flight; none
    under selective recomputation (used inside the checkpoint), and none under the ring
    (--cp-comm-type p2p, the default: its blocks' masks are made and dropped one at a time)."""
    if config.recompute_granularity == "selective" or config.cp_comm_type == "p2p":
        return 0.0
    s, cp = config.seq_length, config.context_parallel_size
    dtype = 2 if config.bf16 or config.fp16 else 4
    return (s // cp) * s * dtype if in_flight else 0.0


@pytest.mark.parametrize("case", range(len(ALL_CASES)), ids=[c[1] for c in ALL_CASES])
def test_predicted_bytes_are_what_a_context_parallel_rank_holds(case, held):
    world, name, model, flags = ALL_CASES[case]
    config = TrainConfig(**model, **flags)
    cp = config.context_parallel_size
    layout = _layout(config, world)  # with its cp
    plan = estimate(config, layout, GPU)
    c = layout_config(config, layout)
    for rank in held[case]:
        r = rank["pp_rank"]
        # The rank's place in the d x cp group that shares gradients and optimizer state.
        shard = rank["dp_rank"] * cp + rank["cp_rank"]
        want = rank_memory(c, layout, layout.dp, r, plan.peak_in_flight[r], dp_rank=shard)
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == rank[part], (name, rank, part, want[part])
        cpu = cpu_mask(config, plan.peak_in_flight[r])
        # fp32: to the byte; 16-bit: the uncounted casts of norm weights and biases (O(h)).
        rel = 0.01 if config.bf16 or config.fp16 else 0.0
        assert rank["saved_peak"] == pytest.approx(want["saved"] + cpu, rel=rel), (name, rank)
        assert rank["saved_after"] == 0


# --- time ----------------------------------------------------------------------------------

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


# --- cp 1, monotony ------------------------------------------------------------------------

ARGV = (
    "--gpu h100-80gb --num-gpus 8 --num-layers 4 --hidden-size 512 --num-attention-heads 8 "
    "--seq-length 1024 --vocab-size 1000 --global-batch-size 16"
)


def test_cp1_is_the_prediction_without_the_flag(capsys):
    without = plan_json(ARGV, capsys)
    assert plan_json(ARGV + " --context-parallel-size 1", capsys) == without


def test_plan_names_the_context_parallel_layout(capsys):
    out = plan_json(ARGV + " --context-parallel-size 2", capsys)
    assert "--context-parallel-size 2" in out["layout"]["flags"]
    for e in out["candidates"]:
        layout = e["layout"]
        assert layout["cp"] == 2 and layout["tp"] * 2 * layout["dp"] * layout["pp"] == 8
        assert e["pipeline_schedule"] in ("1f1b", "interleaved")
        assert layout["tp"] > 1 or not layout["sequence_parallel"]
    # Sequence parallelism is searched with cp as without it (t > 1), and taken when given.
    model = TrainConfig(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=1024,
                        vocab_size=1000, global_batch_size=16)  # fmt: skip
    searched = {(c.tp, c.sequence_parallel) for c in candidates(model, 8, H100, Fixed(cp=2))}
    assert searched == {(1, False), (2, False), (2, True), (4, False), (4, True)}
    # The zero-bubble schedules too, which megart train runs under context parallelism.
    kinds = {c.kind for c in candidates(model, 8, H100, Fixed(cp=2))}
    assert {"zb-h1", "zb-v"} <= kinds, kinds
    given = plan_json(ARGV + " --context-parallel-size 2 --tensor-model-parallel-size 2 "
                      "--sequence-parallel", capsys)  # fmt: skip
    assert "--sequence-parallel" in given["layout"]["flags"]
    assert all(e["layout"]["sequence_parallel"] for e in given["candidates"])


@st.composite
def _models(draw: st.DrawFn, seqs: tuple[int, ...]) -> tuple[TrainConfig, Layout]:
    t = draw(st.sampled_from([1, 2, 4]))
    p = draw(st.sampled_from([1, 2]))
    gqa = draw(st.booleans())
    b = draw(st.sampled_from([1, 2]))
    model = TrainConfig(
        num_layers=4,
        hidden_size=draw(st.sampled_from([1024, 2048])),
        num_attention_heads=8,
        **(dict(group_query_attention=True, num_query_groups=4) if gqa else {}),
        swiglu=draw(st.booleans()),
        seq_length=draw(st.sampled_from(seqs)),
        vocab_size=1000,
        global_batch_size=b * p * 2,
        bf16=draw(st.booleans()),
    )
    rec = draw(st.sampled_from([None, "selective", "full"]))
    return model, Layout(t, p, 1, 1, b, False, rec, draw(st.booleans()))


def _activations(base: TrainConfig, layout: Layout, cps: tuple[int, ...]) -> list[float]:
    held = []
    for cp in cps:
        e = estimate(base, dataclasses.replace(layout, cp=cp), GPU, simulate=False)
        for x in (*e.time.values(), *e.memory.values()):
            assert math.isfinite(x) and x >= 0
        held.append(e.memory["activations"])
    return held


@settings(max_examples=25, deadline=None)
@given(_models(seqs=(256, 512, 1024, 8192, 32768)))
def test_more_context_parallelism_never_holds_more_activations(drawn):
    """For a fixed sequence, d and layout, each doubling of C from 2 on divides every term but
    the gathered keys and values, which stay the whole sequence's."""
    held = _activations(*drawn, (2, 4, 8, 16))
    assert held == sorted(held, reverse=True) and held[-1] < held[0]


@settings(max_examples=25, deadline=None)
@given(_models(seqs=(256, 512, 1024, 8192, 32768)))
def test_context_parallelism_holds_less_than_none(drawn):
    """From C = 1 to 2 the local terms halve and each layer's keys and values become the whole
    sequence's, gathered: less in all, at every length (no mask is kept: see below)."""
    held = _activations(*drawn, (1, 2, 4, 8))
    assert held == sorted(held, reverse=True) and held[-1] < held[0]


def test_long_sequences_keep_the_gathered_keys_and_values_and_no_mask():
    """At s = 32768, C = 2 a layer keeps half its local saves and the whole sequence's K and V,
    nothing of size s^2 (an (s/C) x s mask would be 1 GiB per layer in 16 bits)."""
    base = TrainConfig(num_layers=4, hidden_size=1024, num_attention_heads=8, seq_length=32768,
                       vocab_size=1000, global_batch_size=2, bf16=True,
                       cp_comm_type="all_gather")  # fmt: skip
    layout = Layout(1, 1, 1, 1, 1, False, None, False)
    one, two = _activations(base, layout, (1, 2))
    cfg = base.gpt_config()
    prec = precision(layout_config(base, layout), "megart")
    kv = act.gathered_kv_bytes(cfg, 1, 1, None, prec, 2)
    assert kv == 32768 * 2 * 1024 * 2
    local = act.layer_bytes(cfg, 1, 1, False, None, prec, cp=2) - kv
    assert local == act.layer_bytes(cfg, 1, 1, False, None, prec) / 2
    # One microbatch in flight: four layers' saves, the embedding's and the output layer's.
    ends = [
        act.first_stage_bytes(cfg, 1, 1, cp) + act.last_stage_bytes(cfg, 1, 1, False, prec, cp)
        for cp in (1, 2)
    ]
    assert two < one
    assert two - one == pytest.approx(4 * (kv - local) + ends[1] - ends[0], rel=1e-12)


def test_under_the_ring_long_sequences_keep_no_other_ranks_keys_and_values():
    """--cp-comm-type p2p at s = 32768, C = 2: a layer keeps half its one-process saves and
    its attention output besides the projection's copy of it (h per token, 16-bit), no
    gathered K/V: less than under the all-gather by the whole sequence's K and V, less that."""
    cfg = GPTConfig(num_layers=4, hidden_size=1024, num_attention_heads=8, seq_length=32768,
                    vocab_size=1000, cp_comm_type="p2p")  # fmt: skip
    prec = act.Precision(residual=2, other=2)
    ring = act.layer_bytes(cfg, 1, 1, False, None, prec, cp=2)
    one = act.layer_bytes(cfg, 1, 1, False, None, prec)
    assert ring == one / 2 + 32768 // 2 * 1024 * 2
    gathered = dataclasses.replace(cfg, cp_comm_type="all_gather")
    kv = act.gathered_kv_bytes(gathered, 1, 1, None, prec, 2)
    assert act.layer_bytes(gathered, 1, 1, False, None, prec, cp=2) - ring == kv - 32768 * 1024


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


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,train",
    [
        ("--context-parallel-size 3", dict(context_parallel_size=3)),  # 1024 % 6
        ("--context-parallel-size 0", dict(context_parallel_size=0)),
        (  # each rank's 514 tokens do not split over t = 4
            "--context-parallel-size 2 --tensor-model-parallel-size 4 --sequence-parallel "
            "--seq-length 1028",
            dict(TP2_CP2_SP, tensor_model_parallel_size=4, seq_length=1028),
        ),
        (
            "--context-parallel-size 16",  # 1024 splits, 8 GPUs do not
            dict(context_parallel_size=16),
        ),
    ],
)
def test_plan_refuses_what_megart_train_refuses_in_its_words(extra, train, capsys):
    assert plan_main((ARGV + " " + extra).split()) == 2
    err = capsys.readouterr().err
    model = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=1024,
                 vocab_size=1000, global_batch_size=16, bf16=True)  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        TrainConfig(**{**model, **train}).check(8)
    assert f"megart plan: error: {refused.value}" in err


def test_megatrons_runtime_is_refused_with_context_parallelism(capsys):
    argv = ARGV + " --context-parallel-size 2 --runtime megatron"
    assert plan_main(argv.split()) == 2
    assert "not Megatron-Core's exchanges" in capsys.readouterr().err
