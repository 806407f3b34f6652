"""The relative costs the pipeline's posting plan is made for (:func:`plan_costs`).

The runtime cannot measure its links or its layers before it has run, so the plan is made for
fixed ratios: a guess that errs high on messages, for the reason PLANNED_MESSAGE_SHARE gives.
"""

from __future__ import annotations

from megart import schedule as sched
from megart.training.config import TrainConfig
from megart.training.layer_placement import replayed_layer_count

# Each pipeline message is planned as taking this share of one chunk's forward. A plan made for
# costly messages keeps the schedule's bubble when they turn out free, and one made for free
# messages loses where they are not (bench/pipeline_plan.py: up to 10% of an iteration at this
# share, 20% at twice it), so the plan guesses high; the runtime cannot know its links' speed
# before it has run.
PLANNED_MESSAGE_SHARE = 0.2


def plan_costs(c: TrainConfig) -> sched.Costs:
    """The relative costs the pipeline's posting plan is made for: a layer's input gradient
    and its weight gradient each take about its forward's matrix products (F : I : W = 1 : 1 :
    1), full recomputation runs the forward of the layers it replays again before the input
    gradient (all of them, or under --recompute-method block the first N of each chunk: a
    share of the forward), and a message takes PLANNED_MESSAGE_SHARE of a chunk's forward."""
    backward = 2.0 + replayed_share(c)
    message = PLANNED_MESSAGE_SHARE / c.chunks  # forward = 1 is the rank's whole share
    return sched.Costs(
        forward=1.0, backward=backward, weight_fraction=1.0 / backward, latency=message
    )


def replayed_share(c: TrainConfig) -> float:
    """The share of a rank's forward that full recomputation runs again in its backward: its
    replayed layers over its layers. With even stages every chunk holds as many layers, so the
    share is every rank's. With uneven first/last stages it can differ by rank, but the plan is
    made alike on every rank from one set of costs (one weight_fraction), with every rank's
    forward equal (the split exists to even out the ranks' time, embedding and output layer
    included), so the share is the whole model's: replayed layers over all layers."""
    return replayed_layer_count(c, c.gpt_config()) / c.num_layers
