"""megart plan with context parallelism (--context-parallel-size C given; searched when left out:
test_plan_cp_search.py):
each rank's parameter, gradient and optimizer bytes (the distributed optimizer sharded over
d x C) against real megart train ranks, its saved activations (s/C tokens of every layer, the
keys and values all-gathered over the whole sequence) against
torch's saved-tensor hooks; C = 1 as no flag; more C never more activations; and megart
train's refusals in its words. The attention core's and the exchanges' time:
test_plan_cp_time.py."""

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
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout, layout_config
from megart.plan.memory import precision, rank_memory
from megart.plan.search import Fixed, candidates
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
