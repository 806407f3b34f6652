"""Ring attention, context parallelism's --cp-comm-type p2p (Megatron's default): each rank keeps
its queries and passes keys and values around the cp group in cp steps, folding the partial
attentions by log-sum-exp. At cp2, cp3 and cp4 its output and gradients equal one process's
float64 causal attention (GQA included; one layer and whole models at cp2 and cp4, and at tp2
x cp2 with sequence parallelism, are tests/test_context_parallel.py's, for both exchanges);
`megart train` follows the one-process curve at cp2, tp2 x cp2 with sequence parallelism and
cp2 x pp2, with zero-bubble schedules and recomputation too. The traffic is a ring (cp - 1
K/V blocks to the next rank forward; cp - 1 K/V blocks and cp dK/dV blocks backward; no
collective), and autograd saves no K/V but the rank's own. With dropout it is one process's
attention under the masks it drew. The all-to-all exchange (--cp-comm-type a2a: heads
scattered, the sequence gathered) equals one process in float64 and follows the curve too,
and refuses heads or query groups that cp does not divide. The all-gather exchange is
tests/test_context_parallel.py's."""

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_workers as cw
import ring_workers as rw
from megart import ConfigError
from megart.launcher import launch
from megart.models import flash_blocks
from megart.models.config import GPTConfig
from megart.models.ring_attention import TILE_ELEMENTS, block_of, ring_attention, tiles
from megart.training.config import TrainConfig

F64_ABS = 1e-12
REL = 5e-6  # as tests/test_context_parallel.py's curves
BASE = dict(vocab_size=300, seq_length=16, hidden_size=32, num_layers=2, num_attention_heads=4,
            init_std=0.5, cp_comm_type="p2p")  # fmt: skip
TRAIN = dict(vocab_size=300, train_iters=4, position_embedding_type="rope", init_method_std=0.2,
             normalization="RMSNorm", swiglu=True, group_query_attention=True,
             num_query_groups=2)  # fmt: skip
CASE = dict(seed=1, b=2, heads=4, groups=2, half=3, d=5)


def test_the_blocks_follow_the_load_balanced_chunks():
    """Which of the rank's query rows see which keys of the block visiting at each step,
    against the chunks' global positions: every (query, key) pair with key <= query is in
    exactly one step's block, never a later key, and a pair shown without a causal mask is
    wholly allowed."""
    for cp in (2, 3, 4):
        half, local = 2, 4
        pos = [[c * half + i for c in (r, 2 * cp - 1 - r) for i in range(half)] for r in range(cp)]
        for r in range(cp):
            seen = set()
            for step in range(cp):
                rows, keys, causal = block_of(step, cp, r, local)
                held = pos[(r - step) % cp]
                for qi in range(rows.start, rows.stop):
                    for ki in range(keys.start, keys.stop):
                        q, k = pos[r][qi], held[ki]
                        if causal and ki > qi:
                            continue
                        assert k <= q, (cp, r, step, q, k)
                        seen.add((q, k))
            assert seen == {(q, k) for q in pos[r] for k in range(q + 1)}


def test_tiles_cover_the_rows_within_the_budget():
    assert tiles(slice(4, 8), 8, 2, 1) == [slice(i, i + 1) for i in range(4, 8)]
    assert tiles(slice(4, 8), 8, 2, 48) == [slice(4, 7), slice(7, 8)]  # 3 rows: 48 scores
    assert tiles(slice(0, 8), 8, 2, TILE_ELEMENTS) == [slice(0, 8)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_ring_is_one_process_attention_in_float64(cp):
    """Both kinds of blocks: torch's flash kernel (the CPU's) and explicit products."""
    cases = [CASE, dict(seed=2, b=1, heads=3, groups=3, half=1, d=4),
             dict(seed=3, b=1, heads=2, groups=1, half=2, d=3), dict(CASE, tile=30)]  # fmt: skip
    cases = [dict(c, blocks=kind) for c in cases for kind in ("flash", "explicit")]
    assert max(launch(rw.against_reference, cp, cases, timeout=120)) < F64_ABS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA's flash kernels)")
@pytest.mark.gpu_ranks
@pytest.mark.parametrize("cp", [2, 4])
def test_on_a_gpu_the_flash_ring_in_bf16_is_one_process_attention_in_float64(cp):
    """CUDA's flash kernels, bf16 inputs (GQA: 4 heads in 2 groups of 64), ranks sharing GPU 0
    over megart's nccl transport: output and gradients within bf16's error of float64's."""
    case = dict(seed=5, b=2, heads=4, groups=2, half=64, d=64)
    assert max(launch(rw.against_reference_on_gpu_0, cp, case, timeout=300)) < 2e-2


@pytest.mark.parametrize("window", [None, 2])
def test_the_blocks_are_flash_kernels_where_they_apply(window):
    """Without dropout on the CPU "auto" calls the CPU flash kernel forward and backward and
    no explicit product (with a sliding window too: the masked kernels' pieces,
    tests/test_ring_window_blocks.py); "explicit" the products and no flash kernel; dropout
    keeps the explicit blocks (the CPU kernel has none) and asking for flash with it is
    refused."""
    flash = {"_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward"}  # fmt: skip
    for blocks in ("auto", "explicit"):
        for called in launch(rw.aten_ops_called, 2, dict(CASE, window=window), blocks, timeout=120):
            if blocks == "auto":
                assert flash <= called and "logsumexp" not in called, called
            else:
                assert not flash & called and "logsumexp" in called, called
    q = torch.zeros(1, 2, 4, 8)
    usable = flash_blocks.usable if window is None else flash_blocks.masked_usable
    assert usable(q, 0.0) and not usable(q, 0.1)
    kind = "flash" if window is None else "masked"
    with pytest.raises(ValueError, match=f"{kind} kernels do not take"):
        ring_attention(q, q, q, None, 0.1, blocks="flash", window=window)


@settings(max_examples=15, deadline=None)
@given(
    cp=st.integers(2, 4),
    cases=st.lists(
        st.fixed_dictionaries(
            dict(
                seed=st.integers(0, 2**16),
                b=st.integers(1, 2),
                groups=st.integers(1, 3),
                per_group=st.integers(1, 3),
                half=st.integers(1, 4),
                d=st.integers(1, 6),
                tile=st.sampled_from([1, 5, 24, TILE_ELEMENTS]),
                blocks=st.sampled_from(["flash", "explicit"]),
                window=st.one_of(st.none(), st.integers(0, 45)),
            )
        ),  # fmt: skip
        min_size=1,
        max_size=4,
    ),
)
def test_the_ring_is_one_process_attention_over_shapes(cp, cases):
    """Every launch runs its drawn shapes (heads a multiple of the groups: GQA, MQA, MHA) and
    sliding windows (None: none), each step's block by the CPU's flash kernel (with a window
    the masked kernels' pieces) or by explicit products in tiles of query rows of at most
    ``tile`` scores (one row, a few, whole)."""
    cases = [dict(c, heads=c["groups"] * c.pop("per_group")) for c in cases]
    assert max(launch(rw.against_reference, cp, cases, timeout=120)) < F64_ABS


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_traffic_is_a_ring(cp):
    """Each rank sends only to the next and receives only from the previous: cp - 1 K/V blocks
    forward; cp - 1 K/V blocks and cp dK/dV blocks (its own K/V's size each) backward; no
    collective at all (in particular no all-gather of K/V)."""
    for rank in launch(rw.traffic, cp, CASE, timeout=120):
        kv = rank["kv_bytes"]
        fwd, bwd = rank["forward"], rank["backward"]
        assert fwd["send"] == [(rank["next"], kv)] * (cp - 1)
        assert fwd["recv"] == [(rank["prev"], kv)] * (cp - 1)
        assert sorted(bwd["send"]) == [(rank["next"], kv)] * (2 * cp - 1)
        assert sorted(bwd["recv"]) == [(rank["prev"], kv)] * (2 * cp - 1)
        assert fwd["collectives"] == bwd["collectives"] == []


def test_autograd_saves_no_other_ranks_keys_and_values():
    """One layer (s = 16, cp4: 4 tokens a rank): under the all-gather the saves include the
    gathered K/V (16 tokens long); under the ring no saved tensor reaches past the rank's own 4
    tokens, and the saves are smaller."""
    cfg = dict(BASE, num_layers=1)
    kinds = {}
    for comm in ("all_gather", "p2p"):
        kinds[comm] = launch(rw.saved_by_attention, 4, cfg, comm, timeout=120)
    for gathered, ring in zip(kinds["all_gather"], kinds["p2p"], strict=True):
        assert any(16 in shape for shape in gathered)
        assert all(16 not in shape for shape in ring), ring
        size = [sum(torch.Size(s).numel() for s in saves) for saves in (gathered, ring)]
        assert size[1] < size[0]


@pytest.mark.parametrize("cp", [2, 3])
def test_with_dropout_the_ring_is_one_process_attention_under_its_masks(cp):
    """Attention dropout draws each block's mask from the random stream and the backward draws
    them again: output and gradients equal one process's float64 attention with those kept
    entries applied to the softmax's probabilities (the one-process run's own masks differ:
    a different draw, as under the all-gather)."""
    case = dict(CASE, b=1, half=2)
    assert max(launch(rw.against_reference_with_dropout, cp, case, 0.3, timeout=120)) < F64_ABS


def _losses(nproc, **kw):
    return launch(cw.losses, nproc, {**TRAIN, **kw}, timeout=300)[0]


@pytest.fixture(scope="module")
def straight():
    return _losses(1)


def test_cp2_follows_the_one_process_curve(straight):
    assert _losses(2, context_parallel_size=2) == pytest.approx(straight, rel=REL, abs=0)


def test_cp2_in_bf16_follows_the_one_process_bf16_curve():
    """Under --bf16 the ring's blocks are the CPU flash kernel's in bf16 (the explicit blocks'
    are fp32): within bf16's bound of one process's bf16 curve (the GPU tests' 2e-3; measured
    here 1e-5 to 1e-7 when written)."""
    want = _losses(1, bf16=True)
    assert _losses(2, bf16=True, context_parallel_size=2) == pytest.approx(want, rel=2e-3, abs=0)


def test_tp2_x_cp2_with_sequence_parallelism_follows_the_one_process_curve(straight):
    layout = dict(tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True)
    assert _losses(4, **layout) == pytest.approx(straight, rel=REL, abs=0)


def test_cp2_x_pp2_follows_the_one_process_curve(straight):
    layout = dict(context_parallel_size=2, pipeline_model_parallel_size=2)
    assert _losses(4, train_iters=3, **layout) == pytest.approx(straight[:3], rel=REL, abs=0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v"),
        dict(recompute_granularity="selective"),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ],
    ids=["x pp2 zb-v", "selective recomputation", "full recomputation"],
)
def test_cp2_with_zero_bubble_or_recomputation_follows_the_one_process_curve(straight, kw):
    """The ring's backward runs in the zero-bubble schedule's I (it has no weights); under
    recomputation its forward exchange runs again inside the backward, on every cp rank alike."""
    nproc = 2 * kw.get("pipeline_model_parallel_size", 1)
    losses = _losses(nproc, train_iters=3, context_parallel_size=2, **kw)
    assert losses == pytest.approx(straight[:3], rel=REL, abs=0)


def test_the_default_is_the_ring_and_the_hierarchical_kind_is_refused():
    # Megatron's default, the ring (its blocks flash kernels where they apply).
    assert TrainConfig().cp_comm_type == "p2p" and GPTConfig().cp_comm_type == "p2p"
    TrainConfig(context_parallel_size=2, seq_length=16, cp_comm_type="all_gather").check(2)
    # The sliding window applies under every exchange (tests/test_sliding_window_cp.py).
    for kind in ("p2p", "all_gather", "a2a"):
        TrainConfig(context_parallel_size=2, seq_length=16, cp_comm_type=kind,
                    window_size="4,0").check(2)  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape("--cp-comm-type a2a+p2p: ") + ".*no hier"):
        TrainConfig(context_parallel_size=2, seq_length=16, cp_comm_type="a2a+p2p").check(2)


# --- the all-to-all exchange (--cp-comm-type a2a) ------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
def test_the_all_to_all_exchange_is_one_process_attention_in_float64(cp):
    """Heads (and query groups) scattered over the cp ranks, the sequence gathered: output and
    gradients equal one process's (GQA and MHA; heads and groups divisible by cp)."""
    cases = [dict(seed=1, b=2, heads=8, groups=4, half=3, d=5, kind="a2a"),
             dict(seed=2, b=1, heads=4, groups=4, half=1, d=4, kind="a2a")]  # fmt: skip
    assert max(launch(rw.against_reference, cp, cases, timeout=120)) < F64_ABS


def test_the_all_to_all_exchange_follows_the_one_process_curve(straight):
    layout = dict(context_parallel_size=2, cp_comm_type="a2a")
    assert _losses(2, train_iters=3, **layout) == pytest.approx(straight[:3], rel=REL, abs=0)


def test_the_all_to_all_exchange_at_tp2_x_cp2_with_sequence_parallelism_follows_the_curve():
    """Multi-head (TRAIN's 2 query groups do not split over t x cp = 4): 2 heads a tensor-
    parallel rank, one a context-parallel rank."""
    mha = dict(train_iters=3, group_query_attention=False, num_query_groups=None)
    layout = dict(tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True,
                  cp_comm_type="a2a")  # fmt: skip
    assert _losses(4, **mha, **layout) == pytest.approx(_losses(1, **mha), rel=REL, abs=0)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(num_attention_heads=6, hidden_size=48, context_parallel_size=4),
         "each tensor-parallel rank's 6 attention heads (--num-attention-heads / "
         "--tensor-model-parallel-size 1) over --context-parallel-size 4"),
        (dict(group_query_attention=True, num_query_groups=2, tensor_model_parallel_size=2,
              context_parallel_size=2),
         "each tensor-parallel rank's 1 query group (--num-query-groups / "
         "--tensor-model-parallel-size 2) over --context-parallel-size 2"),
    ],
)  # fmt: skip
def test_the_all_to_all_exchange_needs_heads_and_groups_divisible_by_cp(kw, says):
    config = TrainConfig(**{"seq_length": 16, "cp_comm_type": "a2a", **kw})
    with pytest.raises(ConfigError) as e:
        config.check(config.context_parallel_size * config.tp)
    assert says in str(e.value) and "use --cp-comm-type p2p or all_gather" in str(e.value)


def test_megatrons_per_layer_list_is_taken_when_it_repeats_one_kind():
    """Megatron's --cp-comm-type takes one kind per layer; megart's layers share one, so a list
    of one kind is that kind and a mixed one is refused by name."""
    from megart.cli.train import FlagParser, add_arguments, config_from_args

    parser = FlagParser()
    add_arguments(parser)
    argv = ["--context-parallel-size", "2", "--seq-length", "16", "--cp-comm-type"]
    config = config_from_args(parser.parse_args([*argv, "a2a", "a2a"]))
    assert config.cp_comm_type == "a2a"
    with pytest.raises(ConfigError, match="--cp-comm-type p2p a2a: .*give one kind"):
        config_from_args(parser.parse_args([*argv, "p2p", "a2a"]))
