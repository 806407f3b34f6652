"""Published runs with sequence parallelism and selective recomputation on A100s, for checking
the planner where SC21's table (full recomputation, 2021) cannot: Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198). Not used
for calibration.

- Model FLOPs utilisation (MFU) and the paper's hardware FLOPs utilisation (HFU) of four GPT
  models, measured with a data-parallel size of one: Megatron-LM's README from 2e90a342f5
  (2022-05-19) to the H100 figures that replaced them. Their shapes and layouts are the paper's
  Table 3 (V = 51,200, s = 2,048, micro batch 1, t = 8): 22B on 8 GPUs, global batch 4; 175B
  (GPT-3) p = 8 on 64, batch 64; 530B p = 35 on 280, batch 280; 1T p = 64 on 512, batch 512.
  The README's HFU / MFU equals the paper's counts, (1 + s/(3h) + V/(12 l h)) / (1 + s/(6h) +
  V/(12 l h)), on every row to the figures' rounding (tests/test_plan_korthikanti.py), which
  ties these shapes to the published figures.
- The paper's abstract (REFERENCES.md): 530B on 2,240 A100s, 54.2% MFU with sequence
  parallelism and selective recomputation, 42.1% with full recomputation (and neither). The
  layout is the 280-GPU run's with d = 8; the global batch (2,240, the 280-GPU run's per
  replica) is not published.

Megatron-LM as of the sequence-parallel merge (9aad9203aa, 2022-05-20): the attention's scores
kept (no flash kernel), blocking pipeline exchanges, fp32 gradients all-reduced after the
schedule (bf16 asked for --accumulate-allreduce-grads-in-fp32), interleaving from p = 3, and the
column-parallel products' backward collectives asynchronous (collectives.BACKWARD_OVERLAP)."""

from __future__ import annotations

from dataclasses import dataclass

from megart.plan.collectives import BACKWARD_OVERLAP
from megart.plan.search import Fixed
from megart.training.config import TrainConfig

VOCAB, SEQ = 51200, 2048


@dataclass(frozen=True)
class Run:
    name: str
    heads: int
    hidden: int
    layers: int
    pp: int
    gpus: int
    batch: int
    mfu: float  # per cent, as published
    hfu: float | None = None  # per cent, the paper's count (s/(3h) for the attention)
    full_mfu: float | None = None  # the same run with full recomputation, where published
    tp: int = 8

    def config(self) -> TrainConfig:
        return TrainConfig(
            num_layers=self.layers,
            hidden_size=self.hidden,
            num_attention_heads=self.heads,
            seq_length=SEQ,
            vocab_size=VOCAB,
            global_batch_size=self.batch,
            bf16=True,
        )


README_2022 = (
    Run("22B", 64, 6144, 48, 1, 8, 4, 41.5, 43.7),
    Run("175B", 96, 12288, 96, 8, 64, 64, 51.4, 52.8),
    Run("530B", 128, 20480, 105, 35, 280, 280, 56.0, 57.0),
    Run("1T", 160, 25600, 128, 64, 512, 512, 56.3, 57.0),
)
ABSTRACT_530B = Run("530B", 128, 20480, 105, 35, 2240, 2240, 54.2, full_mfu=42.1)

OPTIONS = dict(
    runtime="megatron",
    unfused_attention=True,
    tp_overlap=BACKWARD_OVERLAP,
    dp_overlap=False,
    grad_reduce_bytes=4,
    pp_overlap=False,
    interleaved_min_pp=3,
)


def fixed(run: Run, selective: bool = True) -> Fixed:
    """The run's (t, p) and micro batch 1, with sequence parallelism and selective
    recomputation (the paper's method) or full recomputation without it (its baseline); the
    interleaving, which the paper does not state, is searched. No distributed optimizer (it
    came to Megatron-LM later in 2022)."""
    return Fixed(
        tp=run.tp,
        pp=run.pp,
        micro_batch=1,
        sequence_parallel=selective,
        recompute="selective" if selective else "full",
        distributed_optimizer=False,
    )


def hfu_over_mfu(run: Run) -> float:
    """The paper's hardware FLOPs over the model's: selective recomputation counted as the
    attention's s/(6h) term once more."""
    s, h, l = SEQ, run.hidden, run.layers
    logits = VOCAB / (12 * l * h)
    return (1 + s / (3 * h) + logits) / (1 + s / (6 * h) + logits)
