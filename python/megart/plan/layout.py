"""A candidate layout of the planner: the sizes megart train's layout flags set."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megart.models.stages import FIRST, LAST, rank_layer_counts
from megart.training.config import TrainConfig

ZERO_BUBBLE = ("zb-h1", "zb-v")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    chunks: int
    micro_batch: int
    sequence_parallel: bool
    recompute: str | None
    distributed_optimizer: bool
    # megart train's --pipeline-schedule; None: its default (1f1b, or interleaved with v > 1).
    schedule: str | None = None
    # Uneven stages: megart train's --decoder-first/last-pipeline-num-layers (None: even).
    first: int | None = None
    last: int | None = None
    # --context-parallel-size: each sequence split over cp ranks (searched when left out).
    cp: int = 1
    # --recompute-method and --recompute-num-layers under full recomputation (None: the base
    # config's, megart train's defaults uniform and 1 unless it sets them). estimate() fills
    # them in where they are not the defaults, so flags() prints a runnable command.
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # flags() spells interleaving by --num-virtual-stages-per-pipeline-rank (as the user did).
    chunks_by_count: bool = False
    # --expert-model-parallel-size: each MoE layer's experts spread over ep of the d
    # data-parallel ranks (megart train runs it at t = cp = 1; searched when left out).
    ep: int = 1

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def layer_counts(self, num_layers: int) -> list[int]:
        """The layers of each pipeline rank (megart.models.stages' placement)."""
        return rank_layer_counts(num_layers, self.pp, self.first, self.last)

    @property
    def kind(self) -> str:
        """The pipeline schedule this layout runs."""
        return self.schedule or ("interleaved" if self.chunks > 1 else "1f1b")

    def sizes(self) -> tuple[int, int, int, int, bool]:
        """(t, p, v, b, sequence parallel)."""
        return self.tp, self.pp, self.chunks, self.micro_batch, self.sequence_parallel

    @property
    def world(self) -> int:
        """GPUs of the layout: t x cp x d x p."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks that average each gradient (and shard the distributed optimizer): d x cp."""
        return self.dp * self.cp

    @property
    def spans(self) -> tuple[str, int]:
        """Full recomputation's --recompute-method and --recompute-num-layers (None: megart
        train's defaults, uniform and 1)."""
        return self.recompute_method or "uniform", self.recompute_num_layers or 1

    @property
    def spans_given(self) -> bool:
        """Whether full recomputation's spans are other than the defaults."""
        return self.spans != ("uniform", 1)

    def flags(self, num_layers: int) -> str:
        """The megart train flags of this layout, for a model of ``num_layers``."""
        out = [
            f"--tensor-model-parallel-size {self.tp}",
            f"--pipeline-model-parallel-size {self.pp}",
            f"--micro-batch-size {self.micro_batch}",
        ]
        if self.cp > 1:
            out.insert(1, f"--context-parallel-size {self.cp}")
        if self.ep > 1:
            out.append(f"--expert-model-parallel-size {self.ep}")
        # The spelling uneven stages take, or the user's.
        if self.kind == "interleaved" and (self.uneven or self.chunks_by_count):
            out.append(f"--num-virtual-stages-per-pipeline-rank {self.chunks}")
        elif self.kind == "interleaved":
            per = num_layers // (self.pp * self.chunks)
            out.append(f"--num-layers-per-virtual-pipeline-stage {per}")
        out += [f"{FIRST} {self.first}"] if self.first is not None else []
        out += [f"{LAST} {self.last}"] if self.last is not None else []
        if self.schedule in ZERO_BUBBLE:
            out.append(f"--pipeline-schedule {self.schedule}")
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.recompute:
            out.append(f"--recompute-granularity {self.recompute}")
        if self.recompute == "full":  # spelt out even at megart's defaults: Megatron-LM asks
            method, n = self.spans  # for both with full recomputation (its arguments.py)
            out += [f"--recompute-method {method}", f"--recompute-num-layers {n}"]
        if self.distributed_optimizer:
            out.append("--use-distributed-optimizer")
        return " ".join(out)

    def short(self) -> str:
        extra = [f"v{self.chunks}"] if self.kind == "interleaved" else []
        extra += [self.kind] if self.kind in ZERO_BUBBLE else []
        extra += [f"first{self.first}"] if self.first is not None else []
        extra += [f"last{self.last}"] if self.last is not None else []
        extra += ["sp"] if self.sequence_parallel else []
        if self.recompute == "full" and self.spans_given:
            extra.append("rc=full-{}{}".format(*self.spans))
        elif self.recompute:
            extra.append(f"rc={self.recompute}")
        extra += ["distopt"] if self.distributed_optimizer else []
        cp = f" c{self.cp}" if self.cp > 1 else ""
        ep = f" e{self.ep}" if self.ep > 1 else ""
        return f"t{self.tp}{cp} p{self.pp} d{self.dp}{ep} b{self.micro_batch}" + "".join(
            " " + e for e in extra
        )


def layout_config(base: TrainConfig, layout: Layout) -> TrainConfig:
    """``base`` with the layout's flags set."""
    per = virtual = None
    if layout.kind == "interleaved" and layout.uneven:
        virtual = layout.chunks  # uneven stages take interleaving in chunks per rank only
    elif layout.kind == "interleaved":
        per = base.num_layers // (layout.pp * layout.chunks)
    return dataclasses.replace(
        base,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        num_layers_per_virtual_pipeline_stage=per,
        num_virtual_stages_per_pipeline_rank=virtual,
        decoder_first_pipeline_num_layers=layout.first,
        decoder_last_pipeline_num_layers=layout.last,
        pipeline_schedule=layout.schedule,
        micro_batch_size=layout.micro_batch,
        sequence_parallel=layout.sequence_parallel,
        recompute_granularity=layout.recompute,
        recompute_method=layout.recompute_method or base.recompute_method,
        recompute_num_layers=layout.recompute_num_layers or base.recompute_num_layers,
        recompute_activations=False,
        use_distributed_optimizer=layout.distributed_optimizer,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
    )
