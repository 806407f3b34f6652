"""The published results megart plan is checked against (REFERENCES.md): every row of SC21
Table 1 (Narayanan et al., A100 80 GB) and of Megatron-Core's H100 table (its r0.8.0 README).
The calibration (bench/plan_tables.py --fit) uses these rows and nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from megart.plan.data_parallel import SINGLE_STAGE
from megart.plan.layout import Layout
from megart.plan.search import Fixed
from megart.training.config import TrainConfig


@dataclass(frozen=True)
class Row:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # per GPU, as published
    micro_batch: int = 0  # what the published run used (0: not published)
    chunks: int = 0

    @property
    def name(self) -> str:
        return f"{self.params_b:g}B"


# SC21 Table 1: V = 51,200, s = 2,048, full recomputation, TFLOP/s counting it. The last two
# numbers are each run's micro batch and model chunks per rank, from Megatron-LM's
# examples/sc21/run_table_1.sh (--micro-batch-size, --num-layers-per-virtual-pipeline-stage;
# no interleaving up to 39.1B), which also ran --fp16.
SC21_TABLE1 = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
)

# Megatron-Core on H100: V = 131,072, s = 4,096, d = 48; GPT models with a 4h GeLU MLP and an
# untied output layer (the parameter counts match only so); TFLOP/s of the model's FLOPs.
MCORE_H100 = (
    Row(1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8),
    Row(7.1, 32, 4096, 30, 2, 1, 96, 192, 465.9),
    Row(16, 48, 6144, 32, 4, 1, 192, 192, 489.1),
    Row(32, 56, 7168, 48, 8, 1, 384, 192, 459.6),
    Row(70, 64, 8192, 84, 8, 2, 768, 384, 419.7),
    Row(119, 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    Row(177, 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    Row(314, 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    Row(462, 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)


@dataclass(frozen=True)
class Table:
    name: str
    gpu: str
    rows: tuple[Row, ...]
    vocab: int
    seq: int
    untied: bool
    unfused_attention: bool  # SC21's Megatron kept the s x s scores; MCore ran flash attention
    tp_overlap: bool | str  # MCore overlaps tensor-parallel collectives with GEMMs; SC21 did not
    # SC21's Megatron all-reduced fp16 gradients after the whole schedule with p > 1 (its
    # local DDP, the only one it allowed there). Its p = 1 runs used torch DDP, which overlapped
    # the all-reduce with the last microbatch's backward: SINGLE_STAGE, as they ran
    # (`bench/plan_tables.py --local-ddp` leaves that overlap out). MCore reduces fp32 gradient
    # buckets during the last backward (as megart does).
    dp_overlap: bool | str
    grad_reduce_bytes: int
    # SC21's Megatron-LM blocked on every pipeline exchange (batch_isend_irecv, wait, then a
    # device synchronise); Megatron-Core overlaps them (--overlap-p2p-communication).
    pp_overlap: bool
    recompute: str | None | bool  # what the runs used (False: search it)
    # Features the runs' Megatron-LM did not have yet: sequence parallelism and the distributed
    # optimizer came in 2022, after SC21 (False: not available; None: search it).
    sequence_parallel: bool | None
    counts_recompute: bool  # whether the published TFLOP/s count recomputed FLOPs
    # SC21's Megatron-LM interleaved only with p > 2 (arguments.py, March 2021 to May 2024).
    interleaved_min_pp: int = 2
    # SC21's Megatron-LM held fp16 gradients and its optimizer's fp32 copies of them, and torch
    # DDP's buckets at p = 1 (runtime_options.gradient_copy_bytes); MCore one fp32 buffer.
    fp32_grad_copies: bool = False


TABLES = (
    Table(
        "SC21 Table 1",
        "a100-80gb",
        SC21_TABLE1,
        51200,
        2048,
        False,
        True,
        False,
        SINGLE_STAGE,
        2,
        False,
        "full",
        False,
        True,
        interleaved_min_pp=3,
        fp32_grad_copies=True,
    ),
    Table(
        "Megatron-Core H100",
        "h100-80gb",
        MCORE_H100,
        131072,
        4096,
        True,
        False,
        True,
        True,
        4,
        True,
        False,
        None,
        False,
    ),
)


def published_layout(row: Row) -> Layout:
    """The row's run exactly as published (SC21 only: the table fixes b and v): Megatron-LM of
    2021, so no sequence parallelism or distributed optimizer."""
    d = row.gpus // (row.tp * row.pp)
    return Layout(row.tp, row.pp, d, row.chunks, row.micro_batch, False, "full", False)


def config(table: Table, row: Row) -> TrainConfig:
    """megart train's flags for the row's model and batch (16-bit compute)."""
    return TrainConfig(
        num_layers=row.layers,
        hidden_size=row.hidden,
        num_attention_heads=row.heads,
        seq_length=table.seq,
        vocab_size=table.vocab,
        global_batch_size=row.batch,
        untie_embeddings_and_output_weights=table.untied,
        bf16=True,
    )


def fixed(table: Table, row: Row | None = None) -> Fixed:
    """The flags the published run fixed: its recomputation, and (with ``row``) its (t, p)."""
    return Fixed(
        tp=row.tp if row else None,
        pp=row.pp if row else None,
        recompute=table.recompute,
        sequence_parallel=table.sequence_parallel,
        distributed_optimizer=table.sequence_parallel,
    )


def model_options(table: Table) -> dict:
    """estimate()'s runtime options for the table's runs."""
    return dict(
        runtime="megatron",
        unfused_attention=table.unfused_attention,
        tp_overlap=table.tp_overlap,
        dp_overlap=table.dp_overlap,
        grad_reduce_bytes=table.grad_reduce_bytes,
        pp_overlap=table.pp_overlap,
        interleaved_min_pp=table.interleaved_min_pp,
        fp32_grad_copies=table.fp32_grad_copies,
    )
