"""A published sweep of alternative layouts on A100 nodes, for checking the planner's choice of
(t, p) against measurement rather than against a chosen layout: BigScience's search for BLOOM's
layout (bigscience-workshop/bigscience, train/tr11-176B-ml/chronicles-prequel.md, the tables
dated 2022-02-25). One 181B GPT (72 layers, h 14,336, 64 heads, s 2,048; BLOOM's 250,880-token
padded vocabulary) on 384 A100 80 GB GPUs of Jean Zay (48 nodes of 8, NVLink inside a node,
4 x 100 Gb/s Omni-Path links per node), trained with Megatron-DeepSpeed: fp16, full
recomputation, ZeRO stage 1 (optimizer state sharded over d), DeepSpeed's pipeline engine (1F1B,
no interleaving, blocking exchanges, gradients reduced after the schedule). Seconds per
iteration as measured at the second iteration (one run each; a repeated layout differed by
2.8%). Not used for calibration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megart.plan.hardware import GPUProfile, load_profile
from megart.plan.layout import Layout
from megart.plan.search import Fixed
from megart.training.config import TrainConfig


@dataclass(frozen=True)
class Run:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    seconds: float | None  # None: the run ran out of memory

    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.dp, 1, self.micro_batch, False, "full", True)


SWEEP_2022_02_25 = (
    Run(8, 6, 8, 4, 1568, 113.01),
    Run(8, 6, 8, 4, 2048, 114.11),
    Run(8, 6, 8, 6, 2016, 123.57),
    Run(8, 12, 4, 4, 1568, 92.75),
    Run(8, 12, 4, 4, 2048, 117.07),
    Run(8, 12, 4, 2, 1568, 99.93),
    Run(8, 12, 4, 2, 2048, 128.82),
    Run(8, 8, 6, 4, 2016, 113.16),
    Run(8, 4, 12, 2, 2016, 125.52),
    Run(8, 4, 12, 4, 2016, 114.81),
    Run(8, 2, 24, 1, 2016, 145.45),
    Run(8, 2, 24, 2, 2016, 136.13),
    Run(8, 1, 48, 1, 2016, None),
    Run(4, 12, 8, 4, 2048, 111.89),
    Run(4, 12, 8, 2, 2048, 110.48),
    Run(4, 6, 16, 4, 2048, 117.11),
    Run(4, 6, 16, 2, 2048, 111.71),
    Run(2, 12, 16, 2, 2048, 112.50),
    Run(2, 6, 32, 2, 2048, None),
    Run(2, 6, 32, 1, 2048, None),
    Run(2, 24, 8, 1, 2048, 119.53),
    Run(2, 24, 8, 2, 2048, 122.75),
    Run(4, 24, 4, 1, 2048, 130.60),
)

GPUS = 384
# estimate()'s runtime options for Megatron-DeepSpeed of February 2022 (fp16 gradients).
OPTIONS = dict(
    runtime="megatron",
    unfused_attention=True,
    tp_overlap=False,
    dp_overlap=False,
    grad_reduce_bytes=2,
    pp_overlap=False,
)
# What the sweep held fixed; (t, p, b) are searched.
FIXED = Fixed(chunks=1, sequence_parallel=False, recompute="full", distributed_optimizer=True)


def config(global_batch: int = 2048) -> TrainConfig:
    return TrainConfig(
        num_layers=72,
        hidden_size=14336,
        num_attention_heads=64,
        seq_length=2048,
        vocab_size=250880,
        global_batch_size=global_batch,
        fp16=True,
    )


def cluster() -> GPUProfile:
    """The a100-80gb profile with Jean Zay's inter-node links: 4 x 100 Gb/s per node shared by
    8 GPUs (6.25 GB/s each), at the profile's 0.95 of line rate; everything else unchanged."""
    a100 = load_profile("a100-80gb")
    return dataclasses.replace(a100, rail_gb_per_s=4 * 12.5 / 8 * 0.95)
