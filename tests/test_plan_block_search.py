"""megart plan's searched --recompute-method block (megart.plan.block_spans): the N chosen is
the smallest whose worst rank fits (against every N estimated), memory falls and time rises
with N (what the search relies on), block is offered only where it can win (uniform 1 fits,
the layout without recomputation does not), the pruning leaves the search's answer as
without it, given spans or a given granularity are not searched, and the JSON keeps its keys."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from megart.errors import ConfigError
from megart.plan.block_spans import smallest_block
from megart.plan.estimate import Estimate, estimate
from megart.plan.hardware import GIB, GPUProfile, load_profile
from megart.plan.layout import Layout
from megart.plan.report import plan_json
from megart.plan.search import Fixed, NoFit, search
from megart.training.config import TrainConfig

search_module = importlib.import_module("megart.plan.search")  # the package re-exports search()
A100 = load_profile("a100-80gb")


def _gpu(usable_gib: float) -> GPUProfile:
    """The A100 profile with ``usable_gib`` GiB usable (nothing else in a plan changes)."""
    total = (usable_gib + A100.workspace_gib) / A100.memory_usable_fraction
    return dataclasses.replace(A100, memory_gib=total)


def _model(layers: int, batch: int, **kw: object) -> TrainConfig:
    model = dict(hidden_size=1024, num_attention_heads=16, seq_length=4096, vocab_size=32000,
                 bf16=True)  # fmt: skip
    model.update(kw)
    return TrainConfig(num_layers=layers, global_batch_size=batch, **model)


def _at(base: TrainConfig, layout: Layout, n: int | None, gpu: GPUProfile, **model) -> Estimate:
    """Quick estimate of ``layout`` under block ``n`` (None: without recomputation)."""
    spans = dict(recompute_method="block", recompute_num_layers=n) if n else {}
    rec = "full" if n else None
    lay = dataclasses.replace(layout, recompute=rec, **spans)
    return estimate(base, lay, gpu, simulate=False, **model)


layouts = st.fixed_dictionaries(
    dict(
        p=st.sampled_from([1, 2, 4]),
        kind=st.sampled_from(["1f1b", "interleaved", "zb-h1", "zb-v", "uneven"]),
        per_chunk=st.integers(2, 7),
        t=st.sampled_from([1, 2]),
        sp=st.booleans(),
        b=st.sampled_from([1, 2]),
        cp=st.sampled_from([1, 2]),
        distopt=st.booleans(),
        rope=st.booleans(),
        runtime=st.sampled_from(["megart", "megatron"]),
    )
)


def _case(d: dict) -> tuple[TrainConfig, Layout, dict]:
    """A model and layout (d = 1) from ``layouts``' draw, and estimate()'s options."""
    p, kind = d["p"], d["kind"]
    if p == 1:
        kind = "1f1b"
    v = 2 if kind in ("interleaved", "zb-v") else 1
    layers = p * v * d["per_chunk"]
    first = last = None
    if kind == "uneven":  # one layer moved from the last stage to the first
        first, last = d["per_chunk"] + 1, d["per_chunk"] - 1
    schedule = kind if kind in ("zb-h1", "zb-v") else None
    cp = 1 if d["runtime"] == "megatron" else d["cp"]
    sp = d["sp"] and d["t"] > 1
    layout = Layout(d["t"], p, 1, v, d["b"], sp, "full", d["distopt"] and cp > 1, schedule,
                    first, last, cp)  # fmt: skip
    kw = dict(position_embedding_type="rope") if d["rope"] else {}
    base = _model(layers, 4 * p * d["b"], **kw)
    return base, layout, dict(runtime=d["runtime"])


@settings(max_examples=150, deadline=None)
@given(d=layouts, where=st.floats(0.0, 1.0))
def test_the_block_chosen_is_the_smallest_n_that_fits(d, where):
    """Against block N estimated for every N of 1 .. a chunk's most layers - 1: memory never
    rises and time never falls as N grows, and smallest_block returns the smallest N that
    fits (None where none does), with or without the layout without recomputation as its
    N = 0 anchor, at a usable memory anywhere from below block's least to above its most."""
    base, layout, model = _case(d)
    most = max(layout.layer_counts(base.num_layers)) // layout.chunks - 1
    try:
        every = [_at(base, layout, n, A100, **model) for n in range(1, most + 1)]
        plain = _at(base, layout, None, A100, **model)
    except ConfigError:
        assume(False)
    mem = [e.memory["total"] for e in every]
    times = [e.iteration_time for e in every]
    assert mem == sorted(mem, reverse=True)
    assert times == sorted(times)
    assert plain.memory["total"] >= mem[0] and plain.iteration_time <= times[0]
    lo, hi = 0.98 * mem[-1] / GIB, 1.02 * mem[0] / GIB
    gpu = _gpu(lo + where * (hi - lo))
    fits = [n for n in range(1, most + 1) if _at(base, layout, n, gpu, **model).fits]
    want = fits[0] if fits else None
    assert fits == (list(range(want, most + 1)) if fits else [])  # monotone at this GPU too
    anchored = _at(base, layout, None, gpu, **model)
    for anchor in (None, anchored):
        got = smallest_block(base, layout, gpu, most, model, plain=anchor)
        assert (got and got.layout.recompute_num_layers) == want, (anchor is None, mem, gpu)
        if got is not None:
            assert got.layout.recompute_method == "block" and got.fits
            assert got.memory["total"] == every[want - 1].memory["total"]


def _fixed(layout: Layout) -> Fixed:
    """Every layout flag fixed but the recomputation (searched)."""
    return Fixed(tp=layout.tp, pp=layout.pp, micro_batch=layout.micro_batch,
                 sequence_parallel=layout.sequence_parallel,
                 distributed_optimizer=layout.distributed_optimizer, schedule=layout.kind,
                 chunks=layout.chunks if layout.kind == "interleaved" else None,
                 cp=layout.cp)  # fmt: skip


# 8 layers of h 1024 at s 4096, pp2 1F1B, b 1, t 1: 4 layers a rank.
WINS = (_model(8, 8), Layout(1, 2, 1, 1, 1, False, "full", False))


def test_search_offers_block_only_where_it_can_win():
    """With only the recomputation searched: a GPU between uniform 1's and no recomputation's
    memory gets block N, N the smallest that fits, faster than uniform 1; one where no
    recomputation fits gets no block (it would replay for nothing), and one where uniform 1
    does not fit none either (block holds more)."""
    base, layout = WINS
    plain = _at(base, layout, None, A100).memory["total"] / GIB
    uniform = estimate(base, layout, A100, simulate=False).memory["total"] / GIB
    blocks = [_at(base, layout, n, A100).memory["total"] / GIB for n in (1, 2, 3)]
    assert plain > blocks[0] > blocks[1] > blocks[2] >= uniform
    gpu = _gpu((blocks[0] + blocks[1]) / 2)  # block 2 is the smallest that fits
    found = search(base, layout.world, gpu, _fixed(layout), keep=8)
    kinds = {e.layout.short().split()[-1]: e for e in found}
    assert "rc=full-block2" in kinds and "rc=full" in kinds
    assert kinds["rc=full-block2"].iteration_time < kinds["rc=full"].iteration_time
    assert not any(e.layout.recompute_method == "block" and e is not kinds["rc=full-block2"]
                   for e in found)  # fmt: skip
    for usable in (plain * 1.01, uniform * 0.99):
        gpu = _gpu(usable)
        try:
            found = search(base, layout.world, gpu, _fixed(layout), keep=8)
        except NoFit as e:  # nothing fits: the closest, no block among them either
            found = e.estimates
        assert not any(e.layout.recompute_method == "block" for e in found), usable


def test_given_spans_or_granularity_are_not_searched():
    """--recompute-method/--recompute-num-layers given (even uniform with another N) or
    --recompute-granularity full given: no block N is searched; the spans searched give one."""
    base, layout = WINS
    blocks = [_at(base, layout, n, A100).memory["total"] / GIB for n in (1, 2)]
    gpu = _gpu((blocks[0] + blocks[1]) / 2)
    searched = search(base, layout.world, gpu, _fixed(layout), keep=8)
    assert any(e.layout.recompute_method == "block" for e in searched)  # the control
    for given_base, fixed in (
        (dataclasses.replace(base, recompute_num_layers=2), _fixed(layout)),
        (dataclasses.replace(base, recompute_method="block", recompute_num_layers=3),
         _fixed(layout)),
        (base, dataclasses.replace(_fixed(layout), recompute="full")),
    ):  # fmt: skip
        found = search(given_base, layout.world, gpu, fixed, keep=8)
        spans = {(e.layout.recompute_method, e.layout.recompute_num_layers)
                 for e in found if e.layout.recompute == "full"}  # fmt: skip
        want = (given_base.recompute_method, given_base.recompute_num_layers)
        assert spans <= {want if want != ("uniform", 1) else (None, None)}, spans


def _every_block(base, quick, gpu, model, short, limit=math.inf) -> list[Estimate]:
    """block_candidates' reference, written apart from it: every layout of ``quick`` without
    recomputation that does not fit, whose uniform 1 fits (or was not estimated), under
    block with the smallest N that fits, found by estimating N = 1, 2, ... in turn (no
    shortlist bar, no time limit)."""
    uniform = {dataclasses.replace(e.layout, recompute=None): e
               for e in quick if e.layout.recompute == "full"}  # fmt: skip
    out = []
    for e in quick:
        full = uniform.get(e.layout)  # the context-parallel shortlist may have left it out
        if e.layout.recompute or e.fits or (full is not None and not full.fits):
            continue
        most = max(e.layout.layer_counts(base.num_layers)) // e.layout.chunks - 1
        for n in range(1, most + 1):
            block = _at(base, e.layout, n, gpu, **model)
            if block.fits:
                out.append(block)
                break
    return out


@settings(max_examples=12, deadline=None)
@given(
    layers=st.sampled_from([16, 32]),
    world=st.sampled_from([2, 4, 8]),
    usable=st.floats(20.0, 70.0),
    keep=st.sampled_from([1, 5, 24]),
    runtime=st.sampled_from(["megart", "megatron"]),
)
# Blocks among other fitting layouts, over several context-parallel sizes: the bars matter.
@example(layers=16, world=8, usable=20.0, keep=24, runtime="megart")
@example(layers=32, world=8, usable=40.0, keep=5, runtime="megart")
@example(layers=32, world=4, usable=40.0, keep=24, runtime="megatron")
def test_pruning_leaves_the_answer_as_planning_every_block(layers, world, usable, keep, runtime):
    """The search with block_candidates (its pruning: the shortlist's bar, the
    context-parallel time limit; smallest_block's probes) returns exactly what it returns with
    every layout's block found by trying each N in turn (_every_block). The
    family (h 4096 at s 16384 on 2-8 GPUs of 20-70 GiB) has block recommended on some GPUs,
    no recomputation on others, and nothing fitting on a few."""
    base = _model(layers, 8, hidden_size=4096, num_attention_heads=32, seq_length=16384)
    gpu = _gpu(usable)

    def run() -> list | str:
        try:
            found = search(base, world, gpu, Fixed(), keep=keep, runtime=runtime)
        except ConfigError as e:
            return str(e)
        return [(e.layout, e.iteration_time, e.memory["total"]) for e in found]

    pruned = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search_module, "block_candidates", _every_block)
        every = run()
    assert pruned == every


def test_json_keeps_its_layout_keys_and_the_flags_carry_the_spans():
    """A block candidate's JSON layout has the keys of every plan's (the spans in "flags"
    only), and its flags, read back into the config, give the same estimate."""
    base, layout = WINS
    blocks = [_at(base, layout, n, A100).memory["total"] / GIB for n in (1, 2)]
    gpu = _gpu((blocks[0] + blocks[1]) / 2)
    found = search(base, layout.world, gpu, _fixed(layout), keep=8)
    plain = search(base, layout.world, A100, _fixed(layout), keep=8)
    keys = {frozenset(c["layout"]) for c in plan_json(found, gpu, layout.world)["candidates"]}
    assert keys == {frozenset(c["layout"]) for c in plan_json(plain, A100, 2)["candidates"]}
    block = next(e for e in found if e.layout.recompute_method == "block")
    flags = block.layout.flags(block.num_layers)
    assert "--recompute-granularity full --recompute-method block --recompute-num-layers 2" in (
        flags
    )
    given_base = dataclasses.replace(base, recompute_method="block", recompute_num_layers=2)
    bare = dataclasses.replace(block.layout, recompute_method=None, recompute_num_layers=None)
    again = estimate(given_base, bare, gpu)
    assert again.memory == block.memory and again.iteration_time == block.iteration_time
