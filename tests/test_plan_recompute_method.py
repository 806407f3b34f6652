"""megart plan under full recomputation with --recompute-method uniform/block and
--recompute-num-layers N, against what real megart train ranks hold (CPU, torch's saved-tensor
hooks, and each replay's saves through torch's recomputation hook: plan_workers.RecomputedBytes)
within 1% as tests/test_plan_memory.py (exact in fp32; under bf16 the difference is each
replayed layer's 16-bit casts of its 1-D weights, O(h) bytes); the replayed work and FLOPs of
the recomputed layers only; the refusals megart train gives; the printed flags. Also one MLP's
replay under --recompute-modules mlp (selective recomputation)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.errors import ConfigError
from megart.launcher import launch
from megart.plan import activations as act
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout, layout_config
from megart.plan.memory import precision, rank_memory
from megart.plan.search import Fixed, search
from megart.training.config import TrainConfig
from megart.training.flops import model_flops
from plan_workers import held_bytes
from test_plan_memory import LLAMA, LLAMA_ROPE, SMALL, _layout

GPU = load_profile("a100-80gb")
FULL = dict(SMALL, recompute_granularity="full")
PP2 = dict(pipeline_model_parallel_size=2)
# Two layers per chunk: interleaved pp2 with 8 layers, 2 per virtual stage.
INTERLEAVED = dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)
TP2_SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)


def _case(name, nproc, layout, method, n, model=FULL, **extra):
    flags = dict(layout, recompute_method=method, recompute_num_layers=n, micro_batch_size=2)
    return (f"{name} {method}{n}", nproc, model, {**flags, **extra})


# Two heads of 32 channels, one sequence per microbatch: rope's tables (32 x 32 fp32 per pair)
# are 2-3% of what a pair keeps with one kept layer.
WIDE_ROPE = dict(LLAMA_ROPE, recompute_granularity="full", num_attention_heads=2,
                 num_query_groups=2)  # fmt: skip


# (name, processes, model, flags): SMALL has 4 layers. Uniform N = 3 leaves a last group of 1
# (the group before it is the replay that rises highest); block N = 4 = every layer.
CASES = [
    *[_case("pp1", 1, {}, "uniform", n) for n in (1, 2, 3)],
    *[_case("pp1", 1, {}, "block", n) for n in (1, 2, 3, 4)],
    *[_case("pp2", 2, PP2, "uniform", n) for n in (1, 2)],
    *[_case("pp2", 2, PP2, "block", n) for n in (1, 2)],
    *[
        _case("pp2 interleaved", 2, INTERLEAVED, m, n, num_layers=8)
        for m, n in (("uniform", 2), ("block", 1), ("block", 2))
    ],  # fmt: skip
    *[_case("tp2 sp", 2, TP2_SP, m, n) for m, n in (("uniform", 2), ("block", 1), ("block", 3))],
    # rope's tables: held by each pair whatever the spans (saved by kept layers, kept by the
    # checkpoints to replay; plan_workers counts them as long as they live), and one a pair
    # (uniform 2: every layer replayed, the tables held by the checkpoints only).
    *[
        _case("llama rope bf16", 1, {}, m, n, model=dict(LLAMA_ROPE, recompute_granularity="full"))
        for m, n in (("uniform", 2), ("block", 1), ("block", 3))
    ],  # fmt: skip
    _case("llama rope bf16 d32", 1, {}, "block", 3, model=WIDE_ROPE, micro_batch_size=1),
]


def _held_and_planned(nproc: int, kw: dict) -> list[tuple[dict, dict, float]]:
    """Each rank of a real ``nproc``-rank run of ``kw``: what it held (plan_workers.held_bytes),
    the plan's rank_memory for it, and the most the plan says it holds during a replay: its
    saves less the loss's (freed before any replay: rank_memory counts them beside the replay
    for the logits' gradient it does not model) plus recompute_working."""
    config = TrainConfig(**kw)
    layout = _layout(config, nproc)
    plan = estimate(config, layout, GPU)
    c = layout_config(config, layout)
    t, p, _, b, sp = layout.sizes()
    out = []
    for held in launch(held_bytes, nproc, kw, timeout=300):
        r = held["pp_rank"]
        want = rank_memory(c, layout, layout.dp, r, plan.peak_in_flight[r])
        loss = act.last_stage_bytes(c.gpt_config(), b, t, sp, precision(c, "megart"))
        out.append(
            (held, want, want["saved"] - (loss if r == p - 1 else 0.0) + want["recompute_working"])
        )
    return out


@pytest.mark.parametrize("name,nproc,model,flags", CASES, ids=[c[0] for c in CASES])
def test_recomputed_spans_hold_what_a_rank_holds(name, nproc, model, flags):
    """The saves autograd keeps (checkpointed spans' inputs, kept layers' whole saves) at the
    peak, and the most held while a span is replayed, as the plan predicts them for each rank:
    its saves less the loss's (freed before any replay: rank_memory counts them beside the
    replay for the logits' gradient it does not model) plus recompute_working."""
    kw = {**model, **flags}
    config = TrainConfig(**kw)
    c = layout_config(config, _layout(config, nproc))
    assert (c.recompute_method, c.recompute_num_layers) == (
        flags["recompute_method"],
        flags["recompute_num_layers"],
    )
    for held, want, replay in _held_and_planned(nproc, kw):
        assert held["saved_peak"] == pytest.approx(want["saved"], rel=0.01), (name, held, want)
        if want["recompute_working"] > 0:
            assert held["recompute_peak"] == pytest.approx(replay, rel=0.01), (name, held, want)
        else:  # block with N below a chunk's layers: the kept layers held more
            assert 0 < held["recompute_peak"] <= replay * 1.01, (name, held, want)
        assert held["saved_after"] == 0


# --recompute-modules mlp: torch's checkpoint replays one MLP at a time in the backward, holding
# its saves at once (and, under sequence parallelism or autocast's copy, its products' input)
# above the layers' kept bytes: recompute_working, as a span's replay above.
MLP_CASES = [
    ("pp2 mlp", 2, dict(SMALL, **PP2, micro_batch_size=2)),
    ("llama-style tp2 sp swiglu mlp", 2, dict(LLAMA, **TP2_SP, micro_batch_size=4)),
    ("pp2 bf16 fp32 residual mlp", 2, dict(SMALL, **PP2, bf16=True, fp32_residual_connection=True,
                                          micro_batch_size=4)),
]  # fmt: skip


@pytest.mark.parametrize("name,nproc,kw", MLP_CASES, ids=[c[0] for c in MLP_CASES])
def test_an_mlps_replay_holds_what_the_plan_counts(name, nproc, kw):
    kw = dict(kw, recompute_granularity="selective", recompute_modules=["mlp"])
    for held, want, replay in _held_and_planned(nproc, kw):
        assert held["saved_peak"] == pytest.approx(want["saved"], rel=0.01), (name, held, want)
        assert want["recompute_working"] > 0
        assert held["recompute_peak"] == pytest.approx(replay, rel=0.01), (name, held, want)


def _base(method: str, n: int, layers: int = 8, **kw: object) -> TrainConfig:
    model = dict(hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=50000,
                 global_batch_size=32)  # fmt: skip
    model.update(kw)
    return TrainConfig(num_layers=layers, recompute_method=method, recompute_num_layers=n,
                       **model)  # fmt: skip


def _full(p: int = 2, v: int = 1, t: int = 1, sp: bool = False) -> Layout:
    return Layout(t, p, 8 // (t * p), v, 2, sp, "full", False)


def test_replayed_work_and_flops_are_the_recomputed_layers_only():
    """Block replays N of each chunk's layers: its time lies between no recomputation and
    every layer replayed by exactly the replayed layers' share, and the TFLOP/s count
    (tflops_per_gpu) adds the recomputed forward of those layers only; model TFLOP/s never
    count recomputation. Uniform replays every layer whatever N."""
    layers, p, v = 8, 2, 2  # 2 layers per chunk, 4 per rank
    layout = _full(p, v)
    every = estimate(_base("uniform", 1, layers), layout, GPU, simulate=False)
    kept = estimate(_base("uniform", 1, layers), dataclasses.replace(layout, recompute=None), GPU,
                    simulate=False)  # fmt: skip
    cfg = _base("uniform", 1, layers).gpt_config()
    batch = 32
    plain = model_flops(cfg, batch, causal=False)
    per_layer = (model_flops(cfg, batch, recompute=True, causal=False) - plain) // layers
    for n in (1, 2, 3):
        block = estimate(_base("block", n, layers), layout, GPU, simulate=False)
        replayed = min(n, layers // (p * v))  # of each chunk
        share = replayed / (layers // (p * v))
        for part in ("forward", "backward"):
            lo, hi = getattr(kept.stage, part), getattr(every.stage, part)
            assert getattr(block.stage, part) == pytest.approx(lo + share * (hi - lo), rel=1e-9)
        flops = plain + per_layer * replayed * p * v
        time, world = block.iteration_time, layout.world
        assert block.tflops_per_gpu == pytest.approx(flops / time / world / 1e12, rel=1e-12)
        assert block.model_tflops_per_gpu == pytest.approx(plain / time / world / 1e12, rel=1e-12)
    for n in (2, 4, 8):  # uniform: every layer replayed, whatever the groups
        uniform = estimate(_base("uniform", n, layers), layout, GPU, simulate=False)
        assert uniform.stage == every.stage
        assert uniform.tflops_per_gpu == every.tflops_per_gpu


@settings(max_examples=25, deadline=None)
@given(
    p=st.sampled_from([1, 2, 4]),
    v=st.sampled_from([1, 2]),
    per_chunk=st.sampled_from([1, 2, 3, 4]),
    t=st.sampled_from([1, 2]),
    sp=st.booleans(),
    rope=st.booleans(),
    unfused=st.booleans(),
)
def test_spans_hold_between_every_layer_replayed_and_none(p, v, per_chunk, t, sp, rope, unfused):
    """Any spans hold no more activations than no recomputation; block holds less the more
    layers it replays, and block with N >= a chunk's layers is uniform with N = 1 (each layer
    its own checkpoint: the same memory and time). Uniform with N = 1 never more than
    selective (the property tests/test_plan.py keeps) — but neither block with N below a
    chunk's layers nor uniform with larger groups: block keeps the other layers' whole saves,
    more than selective when the N replayed layers save less than selective drops over the
    chunk (its attention cores; with --attention unfused the s x s scores), and a uniform
    group's replay holds its layers' whole saves at once (test below)."""
    if v > 1 and p == 1:
        return
    layers = p * v * per_chunk
    kw = dict(position_embedding_type="rope") if rope else {}
    layout = Layout(t, p, 1, v, 1, sp and t > 1, "full", False)
    opts = dict(simulate=False, unfused_attention=unfused)

    def held(method: str | None, n: int = 1) -> float:
        base = _base(method or "uniform", n, layers, global_batch_size=4 * p, **kw)
        lay = layout if method else dataclasses.replace(layout, recompute=None)
        # The worst rank's total: its activations are another rank's when that rank's
        # parameters (the embedding, the output layer) make it the worst.
        return estimate(base, lay, GPU, **opts).memory["total"]

    # A group of every layer of the chunk replayed with one pair in flight holds exactly what
    # no recomputation holds (its input kept, then all its saves at once): equal, summed in
    # another order, so "no more" is to rounding.
    none = held(None) * (1 + 1e-12)
    blocks = [held("block", n) for n in range(1, per_chunk + 2)]
    assert all(b <= none for b in blocks)
    assert blocks == sorted(blocks, reverse=True)
    assert blocks[-1] == blocks[-2] == held("uniform", 1)
    assert all(held("uniform", n) <= none for n in range(1, per_chunk + 1))


def test_block_or_a_large_group_can_hold_more_than_selective():
    """Why test_plan's "full never more than selective" is kept for the default spans only:
    block N = 1 of 8 layers keeps 7 layers' whole saves with --attention unfused's s x s
    scores (selective drops all 8 layers' scores), and uniform N = 8 on one stage replays all
    8 layers at once, each with the scores selective never keeps."""
    layout = Layout(1, 1, 8, 1, 2, False, "full", False)
    sel = dataclasses.replace(layout, recompute="selective")

    def held(base: TrainConfig, lay: Layout) -> float:
        return estimate(base, lay, GPU, unfused_attention=True).memory["activations"]

    selective = held(_base("uniform", 1), sel)
    assert held(_base("uniform", 1), layout) <= selective
    assert held(_base("block", 1), layout) > selective
    assert held(_base("uniform", 8), layout) > selective


def test_search_uses_the_given_spans_for_full_recomputation():
    """With the granularity searched, the full candidates run the user's method and N (the
    search does not vary them) and print them; the others print none."""
    base = _base("block", 2)
    found = search(base, 8, GPU, Fixed(tp=1, pp=2, micro_batch=2, distributed_optimizer=False))
    full = [e for e in found if e.layout.recompute == "full"]
    assert full and len(full) < len(found)
    for e in found:
        flags = e.layout.flags(e.num_layers)
        spans = "--recompute-method block --recompute-num-layers 2" in flags
        assert spans == (e.layout.recompute == "full"), flags
        again = estimate(base, dataclasses.replace(e.layout, recompute_method=None,
                         recompute_num_layers=None), GPU)  # fmt: skip
        assert again.memory == e.memory and again.iteration_time == e.iteration_time


def test_printed_flags_run_the_estimated_layout():
    """Layout.flags() as megart train's TrainConfig reads them gives the same spans, and
    short() names them; the defaults are spelt out in the flags (Megatron-LM asks for both with
    full recomputation) and short() leaves them out."""
    e = estimate(_base("block", 3), _full(), GPU)
    flags = e.layout.flags(e.num_layers).split()
    assert flags[flags.index("--recompute-method") + 1] == "block"
    assert flags[flags.index("--recompute-num-layers") + 1] == "3"
    assert "rc=full-block3" in e.layout.short()
    plain = estimate(_base("uniform", 1), _full(), GPU)
    assert "--recompute-method uniform --recompute-num-layers 1" in plain.layout.flags(8)
    assert plain.layout.short().endswith("rc=full")
    assert "rc=full-uniform2" in estimate(_base("uniform", 2), _full(), GPU).layout.short()


@pytest.mark.parametrize("method,n", [("bogus", 1), ("uniform", 0), ("block", -1)])
def test_the_plan_refuses_what_megart_train_refuses(method, n):
    """The spans megart train refuses are refused in its words; those it runs are planned
    (block N above a chunk's layers replays them all; uniform N not dividing them leaves a
    shorter last group), as Megatron-LM's _checkpointed_forward runs them."""
    with pytest.raises(ConfigError) as train:
        _base(method, n).gpt_config()
    with pytest.raises(ConfigError) as plan:
        estimate(_base(method, n), _full(), GPU)
    assert str(plan.value) == str(train.value)
    for method, n in (("block", 7), ("uniform", 3)):
        e = estimate(_base(method, n), _full(), GPU)
        assert math.isfinite(e.iteration_time) and e.memory["total"] > 0


def test_block_keeps_more_activations_the_fewer_layers_it_replays():
    """Block N keeps every activation of a chunk's other layers: fewer replayed layers, more
    bytes held, and still fewer than without recomputation. Replaying all 4 of a chunk's
    layers peaks as replaying 3 does: the last layer's replay holds 3 inputs and its whole set,
    which block 3 keeps from the start."""
    layout = Layout(1, 2, 1, 1, 1, False, "full", False)
    acts = [estimate(_base("block", n), layout, GPU, simulate=False).memory["activations"]
            for n in (1, 2, 3, 4)]  # fmt: skip
    assert acts == sorted(acts, reverse=True) and len(set(acts)) == 3
    assert acts[2] == acts[3]
    kept = dataclasses.replace(layout, recompute=None)
    assert acts[0] < estimate(_base("block", 1), kept, GPU, simulate=False).memory["activations"]


def test_megatron_runtime_plans_the_spans_with_korthikantis_counts():
    """Under --runtime megatron a span keeps one layer's checkpointed input (2sbh) and block's
    kept layers Korthikanti et al.'s whole count; replaying a uniform group of one makes one
    whole layer live over the kept inputs (its own input shared). One pair in flight (p = 1,
    b = the batch), 4 layers: block 1 holds (4 - 2) x (whole - input) more than uniform 1."""
    layout = Layout(1, 1, 1, 1, 32, False, "full", False)

    def acts(method: str, n: int) -> float:
        e = estimate(_base(method, n, 4), layout, GPU, simulate=False, runtime="megatron")
        return e.memory["activations"]

    cfg = _base("uniform", 1, 4).gpt_config()
    whole = act.megatron_layer_bytes(cfg, 32, 1, False, None, False)
    kept_input = act.megatron_layer_bytes(cfg, 32, 1, False, "full", False)
    assert acts("block", 1) - acts("uniform", 1) == pytest.approx(2 * (whole - kept_input))
    assert acts("block", 3) == acts("block", 4) < acts("block", 2) < acts("block", 1)
