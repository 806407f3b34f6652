"""megart plan's ring (--cp-comm-type p2p) against a real megart train step: the bytes each
rank's transport sends to the next rank of its ring equal the plan's, per layer and microbatch
cp - 1 steps of K and V forward, cp - 1 of them and cp of their fp32 gradients backward, and
the forward's again under either recomputation (the ring runs inside selective
recomputation's checkpoint and saves its tensors after its last step, so the replay passes K
and V round again)."""

from __future__ import annotations

import dataclasses

import pytest

from megart.launcher import launch
from megart.plan.hardware import load_profile
from megart.plan.timing import layer_work
from megart.training.config import TrainConfig
from plan_workers import cp_bytes_sent
from test_plan_memory import LLAMA, SMALL

# A profile whose cp links carry 1 byte a nanosecond with no latency: a layer's cp seconds
# times 1e9 are its bytes.
BYTES = dataclasses.replace(load_profile("a100-80gb"), link_latency_us=0.0)


def planned_bytes(config: TrainConfig, cp: int) -> float:
    """What the plan counts one rank sending in one step: per layer and microbatch."""
    cfg = config.gpt_config()
    w = layer_work(cfg, config.micro_batch_size, config.tp, config.sequence_parallel,
                   cfg.recompute_granularity, BYTES, cp=cp, cp_bus_gb_per_s=1.0)  # fmt: skip
    return w.cp_comm * 1e9 * cfg.num_layers * config.microbatches(1)  # d = 1: world = cp


@pytest.mark.parametrize("rec", [None, "selective", "full"])
@pytest.mark.parametrize(
    "cp,model",
    [(2, SMALL), (4, SMALL), (2, dict(LLAMA, num_query_groups=2, group_query_attention=True))],
    ids=["cp2", "cp4", "cp2-grouped"],
)
def test_the_planned_ring_bytes_are_what_a_real_step_sends(cp, model, rec):
    kw = dict(model, context_parallel_size=cp, cp_comm_type="p2p", micro_batch_size=1,
              train_iters=2, bf16=True)  # fmt: skip
    if rec is not None:
        kw["recompute_granularity"] = rec
    config = TrainConfig(**kw)
    want = planned_bytes(config, cp)
    for rank in launch(cp_bytes_sent, cp, kw, timeout=300):
        ranks = rank["cp_ranks"]
        assert len(rank["sent"]) == 1  # to the next rank of the ring only
        assert list(rank["sent"].values()) == [pytest.approx(want, rel=1e-12)], rank
        assert set(rank["sent"]) <= set(ranks)
