"""The relative costs the pipeline's posting plan is made for (:func:`plan_costs`).

The runtime cannot measure its links or its layers before it has run, so the plan is made for
fixed ratios: a guess that errs high on messages, for the reason PLANNED_MESSAGE_SHARE gives.
"""

from __future__ import annotations

from megart import schedule as sched
from megart.training.config import TrainConfig

# Each pipeline message is planned as taking this share of one chunk's forward. A plan made for
# costly messages keeps the schedule's bubble when they turn out free, and one made for free
# messages loses where they are not (bench/pipeline_plan.py: up to 10% of an iteration at this
# share, 20% at twice it), so the plan guesses high; the runtime cannot know its links' speed
# before it has run.
PLANNED_MESSAGE_SHARE = 0.2


def plan_costs(c: TrainConfig) -> sched.Costs:
    """The relative costs the pipeline's posting plan is made for: a layer's input gradient
    and its weight gradient each take about its forward's matrix products (F : I : W = 1 : 1 :
    1), full recomputation runs the forward again before the input gradient, and a message
    takes PLANNED_MESSAGE_SHARE of a chunk's forward."""
    recomputed = 1.0 if c.recompute_granularity == "full" else 0.0
    backward = 2.0 + recomputed
    message = PLANNED_MESSAGE_SHARE / c.chunks  # forward = 1 is the rank's whole share
    return sched.Costs(
        forward=1.0, backward=backward, weight_fraction=1.0 / backward, latency=message
    )
