"""The rank grid: hand-checked layouts, properties over many layouts, the errors, and
megart.initialize() in real processes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import grid_workers as w
import megart
import megart.distributed as dist
from megart import ConfigError
from megart.launcher import launch
from megart.parallel import ORDERS, check_model_fits, make_layout

# World 16, tp 2, pp 4 in Megatron's order (rank = tp_rank + 2 * (dp_rank + 2 * pp_rank)),
# written out by hand from that definition.
MEGATRON_16 = {
    "tp": [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)],
    "dp": [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)],
    "pp": [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)],
    "mp": [(0, 1, 4, 5, 8, 9, 12, 13), (2, 3, 6, 7, 10, 11, 14, 15)],
    "embedding": [(0, 12), (1, 13), (2, 14), (3, 15)],
}

# World 32 on four nodes of 8, tp 2, pp 4, dp 4: a node is one pipeline stage (8 ranks),
# so each pipeline runs down one rail.
NODES_OF_8 = {
    "tp": [(r, r + 1) for r in range(0, 32, 2)],
    "dp": [
        (0, 2, 4, 6),
        (1, 3, 5, 7),
        (8, 10, 12, 14),
        (9, 11, 13, 15),
        (16, 18, 20, 22),
        (17, 19, 21, 23),
        (24, 26, 28, 30),
        (25, 27, 29, 31),
    ],
    "pp": [(r, r + 8, r + 16, r + 24) for r in range(8)],
    "mp": [
        (0, 1, 8, 9, 16, 17, 24, 25),
        (2, 3, 10, 11, 18, 19, 26, 27),
        (4, 5, 12, 13, 20, 21, 28, 29),
        (6, 7, 14, 15, 22, 23, 30, 31),
    ],
    "embedding": [(r, r + 24) for r in range(8)],
}

# World 8, tp 2, pp 2, dp 2 in order tp-pp-dp: rank = tp_rank + 2 * (pp_rank + 2 * dp_rank).
TP_PP_DP_8 = {
    "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
    "pp": [(0, 2), (1, 3), (4, 6), (5, 7)],
    "dp": [(0, 4), (1, 5), (2, 6), (3, 7)],
    "mp": [(0, 1, 2, 3), (4, 5, 6, 7)],
    "embedding": [(0, 2), (1, 3), (4, 6), (5, 7)],
}


@pytest.mark.parametrize(
    "layout, expected",
    [
        (make_layout(16, tp=2, pp=4), MEGATRON_16),
        (make_layout(16, tp=2, pp=4, dp=2, gpus_per_node=16), MEGATRON_16),
        (make_layout(32, tp=2, pp=4, gpus_per_node=8), NODES_OF_8),
        (make_layout(8, tp=2, pp=2, order="tp-pp-dp", gpus_per_node=4), TP_PP_DP_8),
    ],
)
def test_hand_checked_layouts(layout, expected):
    for kind, groups in expected.items():
        assert layout.groups(kind) == groups, kind


def test_megatron_16_coordinates_and_peers():
    layout = make_layout(16, tp=2, pp=4)
    assert layout.dp == 2
    assert tuple(layout.coords(0)) == (0, 0, 0)
    assert tuple(layout.coords(3)) == (1, 0, 1)  # (tp_rank, pp_rank, dp_rank)
    assert tuple(layout.coords(13)) == (1, 3, 0)
    assert layout.rank_of(tp_rank=0, pp_rank=2, dp_rank=1) == 10
    assert (layout.prev_pp_rank(1), layout.next_pp_rank(1)) == (None, 5)
    assert (layout.prev_pp_rank(9), layout.next_pp_rank(9)) == (5, 13)
    assert (layout.prev_pp_rank(13), layout.next_pp_rank(13)) == (9, None)
    assert layout.pp_ring_neighbours(13) == (9, 1)
    assert layout.pp_ring_neighbours(1) == (13, 5)
    assert layout.group_of("embedding", 5) is None  # a middle stage
    assert layout.group_of("embedding", 13) == (1, 13)


def test_rails_on_nodes_of_8():
    layout = make_layout(32, tp=2, pp=4, gpus_per_node=8)
    assert [layout.rail(r) for r in (0, 7, 8, 13, 31)] == [0, 7, 0, 5, 7]
    assert [layout.node(r) for r in (0, 7, 8, 31)] == [0, 0, 1, 3]
    for pipeline in layout.groups("pp"):
        assert len({layout.rail(r) for r in pipeline}) == 1


def test_one_stage_has_one_rank_embedding_groups_and_no_peers():
    layout = make_layout(4, tp=2)
    assert layout.groups("embedding") == [(0,), (1,), (2,), (3,)]
    assert layout.groups("mp") == layout.groups("tp")
    assert layout.prev_pp_rank(2) is None and layout.next_pp_rank(2) is None
    assert layout.pp_ring_neighbours(2) == (2, 2)


@st.composite
def layouts(draw):
    tp, pp, dp = (draw(st.sampled_from([1, 2, 3, 4])) for _ in range(3))
    world = tp * pp * dp
    gpus_per_node = draw(st.sampled_from(sorted({1, 2, 4, 8, world})))
    return world, tp, pp, dp, draw(st.sampled_from(ORDERS)), gpus_per_node


def _cross_rail_hops(world, tp, pp, dp, order, g):
    """Pipeline hops (wrap-around included) between nodes that change rail, found by walking
    the definition directly rather than through the layout's own check."""
    sizes = {"tp": tp, "pp": pp, "dp": dp}
    dims = order.split("-")
    coords = {}
    for rank in range(world):
        rest, c = rank, {}
        for d in dims:
            c[d] = rest % sizes[d]
            rest //= sizes[d]
        coords[(c["tp"], c["pp"], c["dp"])] = rank
    bad = []
    for (t, p, d), rank in coords.items():
        peer = coords[(t, (p + 1) % pp, d)]
        if rank // g != peer // g and rank % g != peer % g:
            bad.append((rank, peer))
    return bad


@given(layouts())
def test_every_layout_is_a_partition_with_round_trip_coords(case):
    world, tp, pp, dp, order, g = case
    bad_hops = _cross_rail_hops(world, tp, pp, dp, order, g)
    if bad_hops:
        with pytest.raises(ConfigError, match="different rails"):
            make_layout(world, tp, pp, dp, order, g)
        return
    layout = make_layout(world, tp, pp, dp, order, g)
    sizes = {"tp": tp, "pp": pp, "dp": dp, "mp": tp * pp, "embedding": min(pp, 2)}
    for kind, size in sizes.items():
        groups = layout.groups(kind)
        members = [r for group in groups for r in group]
        assert len(members) == len(set(members)), kind  # no rank twice
        assert all(len(group) == size for group in groups), kind
        if kind != "embedding":
            assert sorted(members) == list(range(world)), kind  # every rank once
            assert len(groups) == world // size
        else:  # first and last stages only
            assert sorted(members) == sorted(
                r for r in range(world) if layout.coords(r).pp_rank in (0, pp - 1)
            )
    for rank in range(world):
        c = layout.coords(rank)
        assert layout.rank_of(*c) == rank
        assert layout.group_of("tp", rank)[c.tp_rank] == rank
        assert layout.group_of("pp", rank)[c.pp_rank] == rank
        assert layout.group_of("dp", rank)[c.dp_rank] == rank
        # Members of a group differ from this rank only in the group's coordinate.
        for other in layout.group_of("pp", rank):
            assert (layout.coords(other).tp_rank, layout.coords(other).dp_rank) == (
                c.tp_rank,
                c.dp_rank,
            )
        assert all(layout.coords(o).dp_rank == c.dp_rank for o in layout.group_of("mp", rank))
        nxt = layout.next_pp_rank(rank)
        if nxt is not None:
            assert layout.prev_pp_rank(nxt) == rank
            assert layout.coords(nxt).pp_rank == c.pp_rank + 1
            if layout.node(nxt) != layout.node(rank):
                assert layout.rail(nxt) == layout.rail(rank)


@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]))
def test_megatron_order_keeps_every_pipeline_on_one_rail_when_nodes_divide_tp_dp(tp, pp, dp):
    # In Megatron's order pipeline stages are tp x dp ranks apart; when gpus_per_node divides
    # that, every pipeline peer shares a rail, on one node or not.
    for g in (d for d in (1, 2, 4, 8) if (tp * dp) % d == 0):
        layout = make_layout(tp * pp * dp, tp, pp, dp, gpus_per_node=g)
        for pipeline in layout.groups("pp"):
            assert len({layout.rail(r) for r in pipeline}) == 1


# Errors: each names the numbers and what would fit.


def test_sizes_that_do_not_multiply_to_the_world():
    with pytest.raises(ConfigError) as e:
        make_layout(16, tp=2, pp=4, dp=4)
    assert "tp=2 x pp=4 x dp=4 = 32 ranks, but world_size is 16" in str(e.value)
    assert "dp=2 fits" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_tp_times_pp_that_does_not_divide_the_world_lists_what_fits():
    with pytest.raises(ConfigError) as e:
        make_layout(16, tp=3, pp=2)
    message = str(e.value)
    assert "tp=3 x pp=2 = 6 does not divide world_size=16" in message
    assert "with pp=2, tp can be one of 1, 2, 4, 8" in message
    with pytest.raises(ConfigError, match="with tp=2, pp can be one of 1, 2, 3, 6"):
        make_layout(12, tp=2, pp=5)
    with pytest.raises(ConfigError, match="tp x pp must divide world_size"):
        make_layout(12, tp=5, pp=1, dp=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tp": 0}, "tp must be a positive integer, got 0"),
        ({"pp": 2.0}, "pp must be a positive integer"),
        ({"order": "dp-tp"}, "order 'dp-tp' is not a layout order; use one of tp-dp-pp"),
        ({"gpus_per_node": 0}, "gpus_per_node must be a positive integer"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_layout(8, **kwargs)


def test_a_pipeline_that_would_change_rail_between_nodes_is_refused():
    # Two nodes of 8, Megatron's order: stages are tp x dp = 4 apart, so rank 4 (rail 4, node 0)
    # would feed rank 8 (rail 0, node 1).
    with pytest.raises(ConfigError) as e:
        make_layout(16, tp=2, pp=4, gpus_per_node=8)
    message = str(e.value)
    assert "pipeline peers 4 and 8 are on different nodes (gpus_per_node=8)" in message
    assert "different rails (4 and 0)" in message
    assert "tp x dp = 4 ranks apart" in message
    # tp-pp-dp keeps each pipeline inside a node, and is suggested.
    assert "orders that keep it with these sizes: 'tp-pp-dp'" in message
    assert make_layout(16, tp=2, pp=4, order="tp-pp-dp", gpus_per_node=8).groups("pp")[0] == (
        0,
        2,
        4,
        6,
    )


def test_rank_and_kind_arguments_are_checked():
    layout = make_layout(8, tp=2, pp=2)
    with pytest.raises(ConfigError, match="rank 8 is outside world_size=8"):
        layout.coords(8)
    with pytest.raises(ConfigError, match="pp_rank=2 is outside pp=2"):
        layout.rank_of(0, 2, 0)
    with pytest.raises(ConfigError, match="unknown group kind 'ep'"):
        layout.groups("ep")


# Model checks.


@pytest.mark.parametrize(
    "heads, layers, tp, pp, gpus",
    [  # Table 1 of the SC21 paper (REFERENCES.md), on nodes of 8 GPUs.
        (32, 36, 4, 1, 128),
        (64, 48, 8, 2, 512),
        (96, 80, 8, 8, 1536),
        (128, 105, 8, 35, 2520),
        (160, 128, 8, 64, 3072),
    ],
)
def test_published_layouts_fit(heads, layers, tp, pp, gpus):
    layout = make_layout(gpus, tp=tp, pp=pp, gpus_per_node=8)
    check_model_fits(layout, num_layers=layers, num_attention_heads=heads, vocab_size=51200)


def test_heads_not_divisible_by_tp_say_which_tp_fits():
    layout = make_layout(16, tp=8, pp=2)
    with pytest.raises(ConfigError) as e:
        check_model_fits(layout, num_layers=24, num_attention_heads=12)
    assert "num_attention_heads=12 is not divisible by tp=8" in str(e.value)
    assert "tp that fits (with pp=2, world_size=16): 1, 2, 4" in str(e.value)


def test_query_groups_must_divide_the_heads_and_split_over_tp():
    layout = make_layout(16, tp=4, pp=2)
    check_model_fits(layout, num_layers=24, num_attention_heads=32, num_query_groups=8)
    with pytest.raises(ConfigError) as e:
        check_model_fits(layout, num_layers=24, num_attention_heads=32, num_query_groups=2)
    assert "num_query_groups=2 is not divisible by tp=4" in str(e.value)
    assert "tp that fits (with pp=2, world_size=16): 1, 2" in str(e.value)
    with pytest.raises(ConfigError, match="num_query_groups=3 does not divide num_attention_"):
        check_model_fits(layout, num_layers=24, num_attention_heads=32, num_query_groups=3)
    with pytest.raises(ConfigError, match="num_query_groups must be a positive integer"):
        check_model_fits(layout, num_layers=24, num_attention_heads=32, num_query_groups=0)


def test_layers_not_divisible_by_stages_and_chunks():
    layout = make_layout(16, tp=2, pp=4)
    with pytest.raises(ConfigError) as e:
        check_model_fits(layout, num_layers=30, num_attention_heads=16)
    assert "num_layers=30 is not divisible by pp=4; pp that fits" in str(e.value)
    assert "(with tp=2, chunks=1): 1, 2" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_model_fits(layout, num_layers=24, num_attention_heads=16, chunks=4)
    assert "num_layers=24 is not divisible by pp=4 x chunks=4 = 16" in str(e.value)
    assert "chunks that fit with pp=4: 1, 2, 3, 6" in str(e.value)
    check_model_fits(layout, num_layers=24, num_attention_heads=16, chunks=2)


def test_interleaving_needs_pipeline_stages():
    with pytest.raises(ConfigError, match=r"chunks=2 \(interleaving\) needs pp > 1"):
        check_model_fits(make_layout(4, tp=2), num_layers=24, num_attention_heads=16, chunks=2)


def test_every_model_problem_is_reported_at_once_and_vocab_is_padded_not_checked():
    layout = make_layout(16, tp=4, pp=4)
    with pytest.raises(ConfigError) as e:
        check_model_fits(layout, num_layers=10, num_attention_heads=6, vocab_size=50257)
    assert "num_attention_heads=6" in str(e.value) and "num_layers=10" in str(e.value)
    check_model_fits(layout, num_layers=8, num_attention_heads=8, vocab_size=50257)
    with pytest.raises(ConfigError, match="vocab_size must be a positive integer"):
        check_model_fits(layout, num_layers=8, num_attention_heads=8, vocab_size=0)


# megart.initialize() in real processes.


def _mask(ranks):
    return sum(2**r for r in ranks)


@pytest.mark.parametrize("tp, pp, dp", [(2, 2, None), (2, 1, 2)])
def test_initialize_makes_the_layouts_groups_in_four_processes(tp, pp, dp):
    results = launch(w.grid_groups, 4, tp, pp, dp, timeout=120)
    layout = make_layout(4, tp, pp, dp)
    for rank, got in enumerate(results):
        assert got["coords"] == tuple(layout.coords(rank))
        assert (got["prev"], got["next"]) == (layout.prev_pp_rank(rank), layout.next_pp_rank(rank))
        expected = {
            kind: _mask(layout.group_of(kind, rank))
            for kind in ("tp", "pp", "dp", "mp", "embedding")
            if layout.group_of(kind, rank) is not None
        }
        assert got["masks"] == expected
    # Spelled out for tp=2: ranks {0, 1} and {2, 3} sum together over tp.
    assert [r["masks"]["tp"] for r in results] == [0b0011, 0b0011, 0b1100, 0b1100]
    other = "pp" if pp == 2 else "dp"  # {0, 2} and {1, 3}
    assert [r["masks"][other] for r in results] == [0b0101, 0b1010, 0b0101, 0b1010]


def test_initialize_as_one_process_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    try:
        grid = megart.initialize()
        assert grid.layout == make_layout(1)
        assert (grid.rank, tuple(grid.coords), grid.rail) == (0, (0, 0, 0), 0)
        assert grid.is_first_stage and grid.is_last_stage
        assert grid.tp_group.ranks == grid.embedding_group.ranks == [0]
        dist.destroy()
        with pytest.raises(ConfigError, match="tp=2 x pp=1 = 2 does not divide world_size=1"):
            megart.initialize(tp=2)
        assert not dist.is_initialized()  # a refused layout leaves nothing behind
    finally:
        dist.destroy()
