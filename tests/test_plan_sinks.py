"""megart plan with attention sinks (--softmax-type, megart.models.sinks): the learnable sinks'
parameter, gradient and optimizer bytes against real megart train ranks exactly, and the
activations saved at the peak as without a sink (the same kernels' saves; off-by-one's zero
logits, 4 bytes a head and layer that the plan leaves out, within 1%: 64 of 2,032,224); and
what the plan refuses, by name."""

from __future__ import annotations

import pytest

from megart.errors import ConfigError
from megart.plan.flags import refuse_unmodelled
from megart.training.config import TrainConfig
from plan_memory_check import SMALL, assert_rank_matches, predicted_and_held

ROPE = dict(SMALL, position_embedding_type="rope", global_batch_size=12, micro_batch_size=3)
SINK = dict(ROPE, softmax_type="learnable")
TP2 = dict(tensor_model_parallel_size=2)

# (name, processes, flags, exact activations)
CASES = [
    ("learnable", 1, SINK, True),
    ("learnable tp2 sp", 2, dict(SINK, **TP2, sequence_parallel=True), True),
    ("learnable dp2 distributed optimizer", 2, dict(SINK, use_distributed_optimizer=True), True),
    ("learnable pp2", 2, dict(SINK, pipeline_model_parallel_size=2), True),
    ("off-by-one", 1, dict(ROPE, softmax_type="off-by-one"), False),
]


@pytest.mark.parametrize("name,nproc,kw,exact", CASES, ids=[c[0] for c in CASES])
def test_predicted_bytes_are_what_a_rank_holds(name, nproc, kw, exact):
    for held, want, cpu in predicted_and_held(nproc, kw):
        assert_rank_matches(name, held, want, cpu, exact)


@pytest.mark.parametrize(
    "kw,says",
    [
        (dict(window_size="3,0"), "--softmax-type learnable with --window-size 3,0"),
        (dict(context_parallel_size=2, cp_comm_type="all_gather"), "--cp-comm-type all_gather"),
    ],
)
def test_what_the_plan_does_not_model_is_refused_by_name(kw, says):
    with pytest.raises(ConfigError, match=says):
        refuse_unmodelled(TrainConfig(**SINK, **kw))
    refuse_unmodelled(TrainConfig(**ROPE, **kw))  # a plain softmax plans


def test_the_megatron_runtime_refuses_sinks():
    with pytest.raises(ConfigError, match="--softmax-type learnable"):
        refuse_unmodelled(TrainConfig(**SINK), runtime="megatron")
