"""Uneven first/last pipeline stages (--decoder-first/last-pipeline-num-layers): megart's layer
placement per (pipeline rank, virtual stage) against Megatron-Core's own get_num_layers_to_build
and get_transformer_layer_offset, over many layouts, and the layouts megart refuses against
those Megatron-Core refuses (its TransformerConfig's checks, and a count that is not positive)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.errors import ConfigError
from megart.models import GPTConfig, chunk_layers

pytest.importorskip("megatron.core")
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_layer import (  # noqa: E402
    get_transformer_layer_offset,
)


def megatron_ranges(n: int, pp: int, vp: int, first, last):
    """Megatron-Core's layers of each (pp rank, virtual stage), or None where it refuses."""
    try:
        cfg = TransformerConfig(
            num_layers=n,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,
            virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
        )
    except ValueError:
        return None
    out = {}
    for r in range(pp):
        for c in range(vp):
            stage = c if vp > 1 else None
            try:
                count = get_num_layers_to_build(cfg, stage, r)
                offset = get_transformer_layer_offset(cfg, stage, r)
            except (AssertionError, ZeroDivisionError):  # both end flags, pp 2, interleaved
                return None
            if count <= 0:  # it builds no (or a negative number of) layers there
                return None
            out[r, c] = range(offset, offset + count)
    return out


def megart_ranges(n: int, pp: int, vp: int, first, last):
    cfg = GPTConfig(num_layers=n, hidden_size=8, num_attention_heads=1, vocab_size=16)
    try:
        cfg.check_layout(pp=pp, chunks=vp, first=first, last=last)
    except ConfigError:
        return None
    return {
        (r, c): layers
        for r in range(pp)
        for c, layers in enumerate(chunk_layers(n, r, pp, vp, first=first, last=last))
    }


counts = st.one_of(st.none(), st.integers(-1, 26))


@settings(max_examples=600, deadline=None)
@given(st.integers(1, 24), st.integers(2, 6), st.integers(1, 4), counts, counts)
def test_layer_placement_matches_megatron_core(n, pp, vp, first, last):
    want = megatron_ranges(n, pp, vp, first, last)
    got = megart_ranges(n, pp, vp, first, last)
    assert got == want
    if got is not None:  # every layer exactly once, in virtual-stage order
        order = [got[r, c] for c in range(vp) for r in range(pp)]
        assert [i for layers in order for i in layers] == list(range(n))


@st.composite
def accepted(draw):
    """Layouts Megatron-Core takes: chunk sizes drawn first, the layer count derived."""
    pp, vp = draw(st.integers(2, 6)), draw(st.integers(1, 4))
    first, last = (draw(st.one_of(st.none(), st.integers(1, 4))) for _ in range(2))
    middle_ranks = pp - (first is not None) - (last is not None)
    middle = draw(st.integers(1, 3)) * vp * middle_ranks
    if middle_ranks == 0 and vp > 1:
        vp = 1
    first, last = (None if k is None else k * vp for k in (first, last))
    return (first or 0) + middle + (last or 0), pp, vp, first, last


@settings(max_examples=300, deadline=None)
@given(accepted())
def test_accepted_layouts_match_megatron_core(layout):
    want = megatron_ranges(*layout)
    assert want is not None
    assert megart_ranges(*layout) == want


@pytest.mark.parametrize(
    "n, pp, vp, first, last",
    [
        (10, 4, 1, 1, 3),  # middle 6 over 2 stages
        (10, 4, 2, 2, 4),  # interleaved: middle 4 over 2 stages x 2 chunks
        (7, 2, 1, 3, None),  # pp2, the last stage holds what is left
        (9, 3, 1, None, 1),
        (12, 4, 3, 3, 3),
    ],
)
def test_uneven_examples_match_megatron_core(n, pp, vp, first, last):
    """Layouts Megatron-Core accepts: the same ranges (the property test may draw few)."""
    want = megatron_ranges(n, pp, vp, first, last)
    assert want is not None
    assert megart_ranges(n, pp, vp, first, last) == want


@pytest.mark.parametrize(
    "n, pp, vp, first, last, says",
    [
        (10, 4, 1, 0, 3, "--decoder-first-pipeline-num-layers 0 must be at least 1"),
        (10, 4, 2, 3, 3, "divisible by the 2 model chunks"),
        (10, 4, 1, 2, 3, "leave 5 of --num-layers 10 layers for the other 2 pipeline stage(s)"),
        (8, 2, 1, 3, 4, "must add up to --num-layers 8"),
        (4, 3, 1, 3, 3, "leave -2 of"),
        (4, 2, 2, 2, 2, "no middle stage"),
        (8, 1, 1, 8, None, "--pipeline-model-parallel-size of at least 2"),
    ],
)
def test_refusals_name_the_flags(n, pp, vp, first, last, says):
    assert megatron_ranges(n, pp, vp, first, last) is None or pp == 1
    cfg = GPTConfig(num_layers=n, hidden_size=8, num_attention_heads=1, vocab_size=16)
    with pytest.raises(ConfigError, match="decoder-") as e:
        cfg.check_layout(pp=pp, chunks=vp, first=first, last=last)
    assert says in str(e.value)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 24),
    pp=st.integers(2, 6),
    vp=st.integers(1, 3),
    first=st.none() | st.integers(1, 12),
    last=st.none() | st.integers(1, 12),
)
def test_the_values_a_refusal_suggests_fit_megart_and_megatron_core(n, pp, vp, first, last):
    """Where the other stages cannot hold the layers left evenly, each value the refusal names
    for a flag (the other kept) is a layout both megart and Megatron-Core accept."""
    cfg = GPTConfig(num_layers=n, hidden_size=8, num_attention_heads=1, vocab_size=16)
    try:
        cfg.check_layout(pp=pp, chunks=vp, first=first, last=last)
        return
    except ConfigError as e:
        text = str(e)
    if "pipeline stage(s), which hold them evenly" not in text or "; use " not in text:
        return
    for option in text.split("; use ")[1].split(", or "):
        flag, values = option.split(" ", 1)
        for value in map(int, values.split(" or ")):
            ends = dict(first=first, last=last)
            ends["first" if "first" in flag else "last"] = value
            cfg.check_layout(pp=pp, chunks=vp, **ends)  # accepted
            assert megatron_ranges(n, pp, vp, ends["first"], ends["last"]) is not None


def test_zb_v_refuses_uneven_stages():
    with pytest.raises(ConfigError, match="zb-v .*--decoder-first-pipeline-num-layers"):
        chunk_layers(8, 0, 2, 2, v_shape=True, first=2)
