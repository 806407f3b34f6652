"""megart plan: predict the iteration time, TFLOP/s and memory per GPU of a layout on a cluster,
and recommend the best layout. See docs/plan.md for the model and its calibration."""

from megart.plan.estimate import Estimate, estimate
from megart.plan.hardware import GPUS, GPUProfile, load_profile
from megart.plan.layout import Layout
from megart.plan.search import Fixed, NoFit, search, why_slower

__all__ = [
    "GPUS",
    "Estimate",
    "Fixed",
    "GPUProfile",
    "Layout",
    "NoFit",
    "estimate",
    "load_profile",
    "search",
    "why_slower",
]
