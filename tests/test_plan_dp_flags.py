"""megart plan under megart train's data-parallel flags (--no-overlap-grad-reduce,
--overlap-param-gather, --grad-reduce-in-bf16, --accumulate-allreduce-grads-in-fp32,
--ddp-bucket-size, --ddp-num-buckets): gradient bytes equal to what real CPU ranks hold, the
data-parallel seconds against the formula the runtime implies (megart.training.grad_sync,
megart.training.distributed_optimizer), and train's refusals."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megart.errors import ConfigError
from megart.launcher import launch
from megart.plan.collectives import collective_seconds
from megart.plan.data_parallel import data_parallel_bus_gb_per_s
from megart.plan.estimate import estimate
from megart.plan.hardware import load_profile
from megart.plan.layout import Layout, layout_config
from megart.plan.memory import rank_memory
from megart.plan.parameters import FP32
from megart.training.config import TrainConfig
from plan_workers import held_bytes
from test_plan_memory import SMALL, _layout

GPU = load_profile("a100-80gb")

# (name, processes, flags): dp2 with and without the distributed optimizer, pp2, bf16.
CASES = [
    ("dp2 bf16 reduce", 2, dict(bf16=True, grad_reduce_in_bf16=True, micro_batch_size=2)),
    (
        "dp2 no overlap ddp-bucket-size",
        2,
        dict(overlap_grad_reduce=False, ddp_bucket_size=5000, micro_batch_size=2),
    ),
    (
        "dp2 distributed optimizer bf16 reduce param gather ddp-num-buckets",
        2,
        dict(
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            bf16=True,
            grad_reduce_in_bf16=True,
            ddp_num_buckets=3,
            micro_batch_size=2,
        ),
    ),
    (
        "pp2 x dp2 bf16 half weights distributed optimizer bf16 reduce ddp-bucket-size",
        4,
        dict(
            pipeline_model_parallel_size=2,
            use_distributed_optimizer=True,
            overlap_param_gather=True,
            bf16=True,
            half_weights=True,
            grad_reduce_in_bf16=True,
            ddp_bucket_size=3000,
            accumulate_allreduce_grads_in_fp32=True,
            micro_batch_size=2,
        ),
    ),
    (
        "pp2 x dp2 fp32 no overlap ddp-num-buckets",
        4,
        dict(
            pipeline_model_parallel_size=2,
            overlap_grad_reduce=False,
            ddp_num_buckets=2,
            micro_batch_size=1,
        ),
    ),
]


@pytest.mark.parametrize("name,nproc,flags", CASES, ids=[c[0] for c in CASES])
def test_state_bytes_are_what_a_rank_holds(name, nproc, flags):
    kw = {**SMALL, **flags}
    config = TrainConfig(**kw)
    layout = _layout(config, nproc)
    c = layout_config(config, layout)
    for held in launch(held_bytes, nproc, kw, timeout=300):
        want = rank_memory(c, layout, layout.dp, held["pp_rank"], 1, dp_rank=held["dp_rank"])
        for part in ("parameters", "gradients", "optimizer"):
            assert want[part] == held[part], (name, held, part, want[part])


# A model whose gradient reduction is long enough to matter: 16 layers of h = 1024 on dp8.
BIG = dict(
    num_layers=16,
    hidden_size=1024,
    num_attention_heads=16,
    seq_length=1024,
    vocab_size=32000,
    global_batch_size=64,
    micro_batch_size=2,
    train_iters=10,
)


def _layout_of(dp: int, pp: int = 1, distributed: bool = False, tp: int = 1) -> Layout:
    return Layout(tp, pp, dp, 1, 2, False, None, distributed)


def _split(e, layout: Layout, gpu=GPU) -> tuple[float, float, float]:
    """The runtime's reduction (its kind, all its bytes on the wire per element), and the
    distributed optimizer's all-gather, recomputed from the estimate's gradient buffers."""
    elements = e.memory["gradient_buffers"] / FP32
    dp = layout.dp_cp
    bw = data_parallel_bus_gb_per_s(gpu, layout.tp, dp)
    kind = "reduce_scatter" if layout.distributed_optimizer else "all_reduce"
    return elements, bw, collective_seconds(kind, elements * FP32, dp, bw, gpu)


def test_no_overlap_exposes_the_whole_reduction():
    layout = _layout_of(8)
    e = estimate(TrainConfig(**BIG, overlap_grad_reduce=False), layout, GPU)
    _, _, whole = _split(e, layout)
    assert e.time["dp_comm"] == pytest.approx(whole, rel=1e-12)
    on = estimate(TrainConfig(**BIG), layout, GPU)
    assert on.time["dp_comm"] < whole  # buckets overlap the last backward


def test_bf16_reduce_sends_two_bytes_an_element():
    # megart keeps its fp32 gradients and reduces a bf16 copy of each bucket (grad_sync).
    layout = _layout_of(8, distributed=True)
    flags = dict(BIG, bf16=True, overlap_grad_reduce=False, use_distributed_optimizer=True)
    e = estimate(TrainConfig(**flags, grad_reduce_in_bf16=True), layout, GPU)
    elements, bw, _ = _split(e, layout)
    reduce = collective_seconds("reduce_scatter", elements * 2, 8, bw, GPU)
    gather = collective_seconds("all_gather", elements * FP32, 8, bw, GPU)  # fp32 weights
    assert e.time["dp_comm"] == pytest.approx(reduce + gather, rel=1e-12)
    # The memory: the fp32 buffers stay, and a bf16 copy of each is added.
    plain = estimate(TrainConfig(**flags), layout, GPU)
    assert e.memory["gradient_buffers"] == plain.memory["gradient_buffers"]
    assert e.memory["gradients"] == plain.memory["gradients"] * 3 / 2


@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("buckets", [1, 4, 64])
def test_overlap_leaves_the_last_bucket_exposed(buckets, distributed):
    # Each bucket is reduced once backward has produced it: what outlasts the last backward,
    # at least the last bucket. --ddp-num-buckets N: the rank's parameters // N elements, as
    # megart.training.optimizer counts them: unpadded, where the distributed optimizer pads
    # each bucket to a multiple of d (a few elements at d = 6, which rel=1e-9 sees).
    dp, flags = 6, dict(BIG, global_batch_size=48, ddp_num_buckets=buckets)
    plain = estimate(TrainConfig(**flags), _layout_of(dp), GPU)
    layout = _layout_of(dp, distributed=distributed)
    e = estimate(TrainConfig(**flags, use_distributed_optimizer=distributed), layout, GPU)
    elements, bw, whole = _split(e, layout)
    size = int(plain.memory["parameters"] / FP32) // buckets  # fp32 weights, never padded
    assert e.memory["bucket_elements"] == size
    last = whole * min(1.0, size / elements)
    gather = collective_seconds("all_gather", elements * FP32, dp, bw, GPU) if distributed else 0
    exposed = max(whole - e.stage.backward, last)
    assert e.time["dp_comm"] == pytest.approx(exposed + gather, rel=1e-9)


def test_a_bucket_per_tensor_is_planned_as_such():
    # --ddp-bucket-size 0 (Megatron: every parameter its own bucket) is not megart's 4 MiB:
    # the last bucket, one small tensor, is all that outlasts a long enough last backward.
    layout = _layout_of(8)
    zero = estimate(TrainConfig(**BIG, ddp_bucket_size=0), layout, GPU)
    default = estimate(TrainConfig(**BIG), layout, GPU)
    assert zero.memory["bucket_elements"] == 0 and "bucket_elements" not in default.memory
    _, _, whole = _split(zero, layout)
    assert zero.time["dp_comm"] == pytest.approx(max(whole - zero.stage.backward, 0.0))
    assert zero.time["dp_comm"] < default.time["dp_comm"]


def test_param_gather_overlap_and_fp32_accumulation_change_nothing():
    # --overlap-param-gather: the first chunk's forward waits for all of its buckets, gathered
    # last; --accumulate-allreduce-grads-in-fp32: megart accumulates and keeps fp32 always.
    layout = _layout_of(8, distributed=True)
    base = TrainConfig(**BIG, bf16=True, use_distributed_optimizer=True)
    plain = estimate(base, layout, GPU)
    for flag in ("overlap_param_gather", "accumulate_allreduce_grads_in_fp32"):
        other = estimate(dataclasses.replace(base, **{flag: True}), layout, GPU)
        assert other.time == plain.time and other.memory == plain.memory, flag


@pytest.mark.parametrize(
    "flags,distributed",
    [
        (dict(grad_reduce_in_bf16=True), False),  # without --bf16
        (dict(overlap_param_gather=True), False),  # without the distributed optimizer
        (dict(ddp_bucket_size=10, ddp_num_buckets=2), False),
        (dict(ddp_num_buckets=0), True),
    ],
)
def test_refused_in_trains_words(flags, distributed):
    layout = _layout_of(2, distributed=distributed)
    config = TrainConfig(**BIG, **flags)
    with pytest.raises(ConfigError) as train:
        layout_config(config, layout).check(layout.world)
    with pytest.raises(ConfigError) as plan:
        estimate(config, layout, GPU)
    assert str(plan.value) == str(train.value)


def test_runtime_options_are_megatrons():
    with pytest.raises(ConfigError, match="--no-overlap-grad-reduce"):
        estimate(TrainConfig(**BIG), _layout_of(8), GPU, dp_overlap=False)
    with pytest.raises(ConfigError, match="--grad-reduce-in-bf16"):
        estimate(TrainConfig(**BIG), _layout_of(8), GPU, grad_reduce_bytes=2)


@settings(max_examples=12, deadline=None)
@given(
    dp=st.sampled_from([2, 4, 8, 16, 64]),
    pp=st.sampled_from([1, 2]),
    distributed=st.booleans(),
    bf16_reduce=st.booleans(),
    buckets=st.one_of(st.none(), st.integers(1, 50)),
    hidden=st.sampled_from([256, 1024]),
)
def test_overlap_and_bf16_reduce_are_never_slower(
    dp, pp, distributed, bf16_reduce, buckets, hidden
):
    layout = _layout_of(dp, pp, distributed)
    flags = dict(BIG, hidden_size=hidden, global_batch_size=4 * dp, bf16=True)
    flags.update(use_distributed_optimizer=distributed, ddp_num_buckets=buckets)
    base = TrainConfig(**flags, grad_reduce_in_bf16=bf16_reduce)
    on = estimate(base, layout, GPU)
    off = estimate(dataclasses.replace(base, overlap_grad_reduce=False), layout, GPU)
    assert on.time["dp_comm"] <= off.time["dp_comm"]
    assert on.time["iteration"] <= off.time["iteration"]
    if not bf16_reduce:
        low = estimate(dataclasses.replace(base, grad_reduce_in_bf16=True), layout, GPU)
        assert low.time["dp_comm"] <= on.time["dp_comm"]
        assert low.memory["reduce_copies"] == on.memory["gradient_buffers"] / 2


def test_a_chunks_forward_waits_for_all_its_buckets_under_param_gather_overlap():
    # The runtime fact behind the gather's exposure: with --overlap-param-gather a model
    # chunk's forward pre-hook waits for every bucket of the chunk's parameters first.
    import torch

    from megart.training.distributed_optimizer import DistributedOptimizer
    from megart.training.grad_sync import GradientBuckets

    chunk = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    params = list(chunk.parameters())
    buckets = GradientBuckets(params, None, bucket_bytes=64 * 64 * FP32, shard=True)
    assert len(buckets.buckets) > 2
    zero = DistributedOptimizer([{"params": params}], buckets, torch.optim.AdamW)
    zero.overlap_with_forward([chunk])
    waited: list[list[int]] = []
    zero.wait_for_params = lambda wanted=None: waited.append(list(wanted))
    chunk(torch.zeros(1, 64))
    assert waited[0] == list(range(len(buckets.buckets)))
