"""megart plan's time of a multi-latent attention split over tensor-parallel ranks
(plan.mla_time, timing.layer_work): the collectives it adds to a dense attention's entry and
exit, kind and bytes, are those a real layer runs on two ranks, with and without sequence
parallelism and --q-lora-rank, forward and backward; and its products are training.flops'
MLA count."""

from __future__ import annotations

from collections import Counter

import pytest

import plan_mla_workers as pmw
from megart.launcher import launch
from megart.models.config import GPTConfig
from megart.plan.mla_time import (
    mla_collectives,
    mla_column_shapes,
    mla_output_score_value_widths,
)
from megart.training.flops import mla_widths as flops_widths

MLA = dict(vocab_size=256, seq_length=16, hidden_size=32, num_layers=1, num_attention_heads=4,
           multi_latent_attention=True, position_embedding="rotary", kv_lora_rank=12,
           qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)  # fmt: skip
# (GPTConfig fields, sequence length, batch, sequence parallelism)
CASES = {
    "kv latent": (MLA, 16, 3, False),
    "q-lora": (dict(MLA, q_lora_rank=20), 16, 3, False),
    "sp kv latent": (MLA, 16, 3, True),
    "sp q-lora qk-layernorm": (dict(MLA, q_lora_rank=20, qk_layernorm=True), 16, 3, True),
}


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    """Each case's record on each of the two ranks (one launch for all)."""
    ranks = launch(pmw.collectives, pmw.TP, list(CASES.values()), timeout=300)
    return {name: [r[i] for r in ranks] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_the_mla_collectives_are_what_a_tp2_layer_runs(name, measured):
    """fp32: 4 bytes an element. The dense attention's own pair (timing.layer_work's): the
    entry's gather and the projection's reduce-scatter with sequence parallelism (backward the
    output gradient's gather and the input gradient's reduce-scatter), else one all-reduce
    each way."""
    kw, s, b, sp = CASES[name]
    cfg = GPTConfig(**kw)
    tokens = s * b
    forward, backward = mla_collectives(cfg, tokens, pmw.TP, sp, 4)
    one = tokens * cfg.hidden_size * 4
    if sp:
        forward += [("all_gather", one), ("reduce_scatter", one)]
        backward += [("all_gather", one), ("reduce_scatter", one)]
    else:
        forward, backward = forward + [("all_reduce", one)], backward + [("all_reduce", one)]
    for rank in measured[name]:
        assert Counter(map(tuple, rank["forward"])) == Counter(forward), (name, rank)
        assert Counter(map(tuple, rank["backward"])) == Counter(backward), (name, rank)


@pytest.mark.parametrize("name", list(CASES))
def test_the_mla_products_are_the_flop_counts(name):
    """The plan's products over all t ranks are training.flops' per-token multiply-adds
    (the projections), and its core's widths the scores' and values' per head."""
    cfg = GPTConfig(**CASES[name][0])
    projections, core = flops_widths(cfg)
    out_width, score, value = mla_output_score_value_widths(cfg)
    columns = sum(cols * inner for cols, inner in mla_column_shapes(cfg, pmw.TP)) * pmw.TP
    assert columns + cfg.hidden_size * out_width == projections
    assert cfg.num_attention_heads * (score + value) == core
