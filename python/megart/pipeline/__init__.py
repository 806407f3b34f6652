"""Pipeline parallelism: the engine that executes the C++ schedules on model chunks."""

from megart.pipeline.engine import PipelineEngine
from megart.pipeline.p2p import StageLink

__all__ = ["PipelineEngine", "StageLink"]
