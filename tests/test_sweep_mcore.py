"""tests/sweep.py's mcore mode catches what it exists to catch: a mapping between megart's GPT
and Megatron-Core's GPTModel that is off by one weight's 1e-8, or a rope pairing one side reads
otherwise, is a MISMATCH; the same model mapped right is OK; a model GPTConfig refuses is
REFUSED with its reason; and the draws are models of the options the mode claims. The
mcore-tp2 and mcore-pp2 modes (Megatron-Core on the tp2 and pp2 files megart converts to) catch
shards and layers on the wrong rank, chunk or stage."""

from __future__ import annotations

import random

import pytest

import sweep
import sweep_mcore
import sweep_mcore_pp
import sweep_mcore_tp
from megart import ConfigError
from megart.launcher import launch
from megart.models import GPTConfig

LLAMA = dict(vocab_size=100, seq_length=12, hidden_size=32, num_layers=2, num_attention_heads=4,
             normalization="rmsnorm", position_embedding="rotary", activation="swiglu",
             bias=False, untie_embeddings_and_output_weights=True, num_query_groups=2)  # fmt: skip


def _check(kw: dict, sabotage: str | None = None) -> str:
    return sweep_mcore.check(kw, launch, sweep._failed, sweep.TOLERANCE["mcore"], sabotage)


@pytest.mark.parametrize("sabotage", [None, "weight", "interleaved"])
def test_a_wrong_mapping_is_a_mismatch_and_the_right_one_is_ok(sabotage):
    pytest.importorskip("megatron.core")
    verdict = _check(LLAMA, sabotage)
    if sabotage is None:
        assert verdict.startswith("OK"), verdict
    else:
        assert verdict.startswith("MISMATCH"), verdict
    # The largest of both directions' differences comes first, then each.
    worst = float(verdict.split()[1])
    assert (worst < 1e-12) if sabotage is None else (worst > 1e-10)


def test_a_refused_model_is_refused_with_megarts_reason():
    verdict = _check(dict(LLAMA, num_query_groups=3))
    assert verdict.startswith("REFUSED") and "num_query_groups=3" in verdict, verdict


def test_the_draws_are_small_models_of_the_options_claimed():
    rng = random.Random(0)
    draws = [sweep_mcore.config(rng) for _ in range(300)]
    for kw in draws:
        assert 1 <= kw["num_layers"] <= 3 and 2 <= kw["num_attention_heads"] <= 8
        assert 8 <= kw["seq_length"] <= 16 and 16 <= kw["hidden_size"] <= 64
        # What Megatron-Core's local spec cannot do is drawn around (see sweep_mcore).
        assert not (kw.get("apply_layernorm_1p") and kw.get("normalization") == "rmsnorm")
        assert kw.get("window_size", (0, 0))[0] >= 0
    seen = {k for kw in draws for k in kw}
    fields = {"normalization", "apply_layernorm_1p", "rotary_base", "rotary_interleaved",
              "rotary_percent", "rope_scaling", "rope_scaling_factor",
              "rotary_seq_len_interpolation_factor", "activation", "bias", "add_qkv_bias",
              "untie_embeddings_and_output_weights", "num_query_groups", "kv_channels",
              "qk_layernorm", "window_size", "window_attn_skip_freq", "ffn_hidden_size",
              "layernorm_epsilon", "make_vocab_size_divisible_by"}  # fmt: skip
    assert fields <= seen, fields - seen
    padded = [kw for kw in draws if GPTConfig(vocab_size=kw["vocab_size"]).padded_vocab_size(1)
              != kw["vocab_size"]]  # fmt: skip
    assert len(padded) > 50


def test_without_megatron_core_a_draw_is_skipped(monkeypatch):
    # test_sweep's two draws of every mode then pass where megatron-core is not installed.
    monkeypatch.setattr(sweep_mcore.importlib.util, "find_spec", lambda name: None)
    verdict = sweep.one(random.Random(0), "mcore")
    assert verdict.startswith("SKIP") and "megatron-core" in verdict, verdict


@pytest.mark.parametrize("swap", [False, True])
def test_mcore_tp2_catches_ranks_that_hold_each_others_shards(swap):
    """The mcore-tp2 mode: Megatron-Core's tp2 model on the tp2 files megart converts to gives
    megart's logits; each rank given the other's file (a rank-order mistake) does not."""
    pytest.importorskip("megatron.core")
    verdict = sweep_mcore_tp.check(LLAMA, launch, sweep._failed, sweep.TOLERANCE["mcore-tp2"],
                                   swap_ranks=swap)  # fmt: skip
    assert verdict.startswith("MISMATCH" if swap else "OK"), verdict


PP_MODEL = dict(LLAMA, num_layers=4, untie_embeddings_and_output_weights=False)
INTERLEAVED = dict(tp=1, pp=2, vpp=2)


@pytest.mark.parametrize(
    "layout, sabotage",
    [(INTERLEAVED, None), (INTERLEAVED, "v"), (INTERLEAVED, "chunks"), (dict(tp=1, pp=2), "ranks")],
)
def test_mcore_pp2_catches_layers_on_other_stages_than_megatrons(layout, sabotage):
    """The mcore-pp2 mode: Megatron-Core's pipeline stages on the interleaved pp2 files megart
    converts to give megart's logits; the same files with layers where Megatron does not place
    them do not: zb-v's V (rank 0 holding stage 3's layers, rank 1 stage 2's), a rank's two
    chunks in the other order, or under plain pp2 each rank holding the other's layers."""
    pytest.importorskip("megatron.core")
    tolerance = sweep.TOLERANCE["mcore-pp2"]
    verdict = sweep_mcore_pp.check(PP_MODEL, layout, launch, sweep._failed, tolerance, sabotage)
    assert verdict.startswith("MISMATCH" if sabotage else "OK"), verdict


def test_mcore_pp2_draws_run_clean():
    """Three draws of the sweep's seed 32 (an MoE model on pp2, interleaved with an uneven last
    stage, interleaved): each is OK. (Seeds 21 and 30, before the sweep drew MoE models and
    then shared experts and the router's options, changed with the draws.)"""
    pytest.importorskip("megatron.core")
    rng = random.Random(32)
    verdicts = [sweep.one(rng, "mcore-pp2") for _ in range(3)]
    assert all(v.startswith("OK") for v in verdicts), verdicts
    assert [v.split(" {")[0].split(") ")[1] for v in verdicts] == [
        "pp2", "pp2 vpp=2 last=4", "pp2 vpp=2"
    ]  # fmt: skip
    assert "num_experts" in verdicts[0]


def test_mcore_pp2_draws_every_layout_and_mostly_ones_that_fit():
    rng = random.Random(0)
    draws = [sweep_mcore_pp.layout(rng) for _ in range(300)]
    kinds = {(o.get("vpp", 1), "first" in o, "last" in o) for _, o in draws}
    assert kinds == {(v, f, la) for v in (1, 2) for f, la in ((0, 0), (1, 0), (0, 1))} | {
        (1, True, True)
    }, kinds
    fits = 0
    for layers, o in draws:
        assert 2 <= layers <= 9
        try:
            GPTConfig(num_layers=layers).check_layout(1, 2, o.get("vpp", 1), o.get("first"),
                                                      o.get("last"))  # fmt: skip
            fits += 1
        except ConfigError:
            pass
    assert 0.85 * len(draws) < fits < len(draws)


def test_megart_to_megatron_refuses_fewer_than_one_virtual_stage(tmp_path):
    from megart.training.megatron_checkpoint import megart_to_megatron

    with pytest.raises(
        ConfigError, match="--target-num-virtual-stages-per-pipeline-rank 0: give 1 or more"
    ):
        megart_to_megatron(tmp_path, tmp_path / "out", 1, 2, vpp=0)
