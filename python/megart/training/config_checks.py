"""The checks a training configuration passes before any work: layouts, batch shapes and the
pipeline schedule (the model flags': model_flags.py; the data sources': data_checks.py; the
learning rate's and weight decay's: lr_checks.py). Each error names
the flags and numbers and says what would fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.errors import ConfigError
from megart.models.moe_checks import check_moe_tensor_parallel
from megart.models.stages import uneven
from megart.parallel.layout import nearest_multiples
from megart.training.batch_rampup import check_rampup
from megart.training.context_parallel_checks import (
    check_context_parallel,
    check_sequence_parallel_split,
)
from megart.training.data_checks import (
    check_data_sources,
    check_megatron_order,
    refuse_full_validation,
    split_weights,
)
from megart.training.documents import check_document_flags
from megart.training.expert_checks import check_expert_flags
from megart.training.lr_checks import check_lr_flags
from megart.training.megatron_flags import check_megatron_flags
from megart.training.megatron_mla import refuse_mla_yarn
from megart.training.moe_kernels import check_moe_kernels
from megart.training.mtp_checks import check_mtp_flags
from megart.training.save_modes import check_save_modes
from megart.training.upcycling_checks import check_upcycling

if TYPE_CHECKING:
    from megart.training.config import TrainConfig

# The pipeline schedules `megart train` runs (megart.schedule builds more, gpipe among them).
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")


def _check_loss_scale(cfg: TrainConfig) -> None:
    """The loss-scaling flags, checked only with --fp16, the one run they change: without it
    megart ignores them. Megatron-Core ignores the dynamic scaler's flags then too, but applies
    a static --loss-scale under --bf16 (its ConstantGradScaler); with bf16's fp32 exponent
    range a power-of-two scale changes no gradient, so only another scale's rounding differs.
    A static --loss-scale ignores the dynamic scaler's flags (Megatron-Core builds its
    ConstantGradScaler then, which checks only the scale)."""
    if cfg.loss_scale is not None and not cfg.loss_scale > 0:
        raise ConfigError(f"--loss-scale {cfg.loss_scale:g} must be positive")
    if cfg.loss_scale is not None:
        return
    if cfg.hysteresis < 1:
        raise ConfigError(
            f"--hysteresis {cfg.hysteresis}: the fp16 loss scale halves at this overflow "
            "since it last grew; give at least 1 (1: at every overflow; Megatron's default, "
            "and megart's, is 2)"
        )
    if cfg.loss_scale_window < 1:
        raise ConfigError(
            f"--loss-scale-window {cfg.loss_scale_window}: the overflow-free iterations before "
            "the fp16 loss scale doubles; give at least 1 (Megatron's default, and megart's, "
            "is 1000)"
        )
    for flag, value in (("--initial-loss-scale", cfg.initial_loss_scale),
                        ("--min-loss-scale", cfg.min_loss_scale)):  # fmt: skip
        if not value > 0:
            raise ConfigError(f"{flag} {value:g} must be positive")


def check_two_stages(flag: str, pp: int) -> None:
    """Interleaving (``flag``) splits each of at least two pipeline stages into chunks."""
    if pp < 2:
        raise ConfigError(f"{flag} needs --pipeline-model-parallel-size of at least 2")


def check_config(cfg: TrainConfig, world_size: int) -> int:
    """Refuses layouts, batch shapes and flag combinations that cannot run, naming the
    numbers and flags and what would fit; returns the data-parallel size."""
    tp, pp = cfg.tp, cfg.pp
    check_context_parallel(cfg)  # a valid cp before it divides the world
    cp = cfg.context_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp * cp):
        by_cp = f" x context-parallel {cp} (--context-parallel-size {cp})" if cp > 1 else ""
        raise ConfigError(
            f"{world_size} process{'es do' if world_size > 1 else ' does'} not split into "
            f"tensor-parallel {tp}{by_cp} x pipeline-parallel {pp}; the product must divide "
            f"the number of processes: start a multiple of {max(1, tp * pp * cp)} (torchrun "
            "--nproc-per-node N starts N) or choose smaller sizes"
        )
    dp = world_size // (tp * pp * cp)
    if cfg.micro_batch_size < 1 or cfg.global_batch_size < 1:
        raise ConfigError(
            f"--micro-batch-size {cfg.micro_batch_size} and --global-batch-size "
            f"{cfg.global_batch_size} must be at least 1"
        )
    if cfg.distributed_timeout_minutes <= 0:
        raise ConfigError(
            f"--distributed-timeout-minutes {cfg.distributed_timeout_minutes} must be above 0"
        )
    per_step = cfg.micro_batch_size * dp
    if cfg.global_batch_size % per_step:
        raise ConfigError(
            f"--global-batch-size {cfg.global_batch_size} is not divisible by "
            f"--micro-batch-size {cfg.micro_batch_size} x data-parallel size {dp} = "
            f"{per_step}; use a global batch of "
            f"{nearest_multiples(cfg.global_batch_size, per_step)}"
        )
    per = cfg.num_layers_per_virtual_pipeline_stage
    _check_virtual_flags(cfg)
    _check_uneven(cfg)
    _check_schedule(cfg, dp)
    check_rampup(cfg, dp)
    if cfg.schedule == "interleaved":
        flag = "--num-layers-per-virtual-pipeline-stage"
        check_two_stages(flag if per is not None else "--num-virtual-stages-per-pipeline-rank", pp)
        if per is not None:
            check_virtual_stages(cfg.num_layers, pp, per)
        m = cfg.microbatches(dp)
        if m % pp:  # the batches whose microbatches fill whole rounds of the stages
            batches = nearest_multiples(cfg.global_batch_size, per_step * pp)
            raise ConfigError(
                f"the interleaved schedule needs the number of microbatches ({m} = global "
                f"batch {cfg.global_batch_size} / (micro batch {cfg.micro_batch_size} x "
                f"data-parallel {dp})) to be a multiple of the pipeline size ({pp}); use a "
                f"global batch of {batches}"
            )
    elif cfg.num_layers % pp and not uneven(**cfg.stages):
        raise ConfigError(
            f"--num-layers {cfg.num_layers} is not divisible by --pipeline-model-parallel-size {pp}"
        )
    if cfg.sequence_parallel:
        check_sequence_parallel_split(cfg.seq_length, tp, cp)
    if cfg.train_iters < 1 or cfg.log_interval < 1:
        raise ConfigError("--train-iters and --log-interval must be at least 1")
    if cfg.eval_iters < 0 or cfg.eval_interval < 1:
        raise ConfigError(
            f"--eval-iters {cfg.eval_iters} must be at least 0 (0: no evaluation) and "
            f"--eval-interval {cfg.eval_interval} at least 1"
        )
    _check_eval_batch(cfg, dp)
    split_weights(cfg.split)
    check_data_sources(cfg)
    check_megatron_order(cfg)
    refuse_full_validation(cfg)
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("--bf16 and --fp16 exclude each other; choose one")
    if cfg.half_weights and not (cfg.bf16 or cfg.fp16):
        raise ConfigError(
            "--half-weights keeps the weights in the 16-bit type of --bf16 or --fp16; add one "
            "of them (without, the weights are fp32)"
        )
    if cfg.fp16:
        _check_loss_scale(cfg)
    if cfg.save_interval is not None and (cfg.save_interval < 1 or not cfg.save):
        raise ConfigError(
            f"--save-interval {cfg.save_interval} needs --save DIR and a value of at least 1"
        )
    retain = cfg.save_retain_interval
    if retain is not None and not (
        cfg.save_interval and retain > 0 and retain % cfg.save_interval == 0
    ):
        raise ConfigError(
            f"--save-retain-interval {retain} must be a positive multiple of --save-interval "
            f"({cfg.save_interval}), as in Megatron-LM: give both, e.g. --save-interval "
            f"{cfg.save_interval or 100} --save-retain-interval {10 * (cfg.save_interval or 100)}"
        )
    if (cfg.exit_interval is not None and cfg.exit_interval < 1) or (
        cfg.exit_duration_in_mins is not None and cfg.exit_duration_in_mins < 0
    ):
        raise ConfigError(
            f"--exit-interval {cfg.exit_interval} must be at least 1 and "
            f"--exit-duration-in-mins {cfg.exit_duration_in_mins} at least 0 (leave them "
            "out to train all --train-iters)"
        )
    loading = ("no_load_optim", "no_load_rng", "finetune", "exit_on_missing_checkpoint")
    given = [f for f in loading if getattr(cfg, f)] + (
        ["ckpt_step"] if cfg.ckpt_step is not None else []
    )
    if given and not (cfg.load or cfg.pretrained_checkpoint):
        flags = " and ".join("--" + f.replace("_", "-") for f in given)
        raise ConfigError(f"{flags} choose what --load DIR restores; give --load DIR")
    if cfg.ckpt_step is not None and cfg.ckpt_step < 0:
        raise ConfigError(f"--ckpt-step {cfg.ckpt_step}: give an iteration that --load holds")
    saving = [f for f in ("no_save_optim", "no_save_rng") if getattr(cfg, f)]
    if saving and not cfg.save:
        flags = " and ".join("--" + f.replace("_", "-") for f in saving)
        raise ConfigError(f"{flags} choose what --save DIR writes; give --save DIR")
    if saving and cfg.ckpt_format == "torch_dist":
        flags = " and ".join("--" + f.replace("_", "-") for f in saving)
        raise ConfigError(
            f"{flags} with --ckpt-format torch_dist: megart writes Megatron's distributed "
            "store whole; use --ckpt-format megart or torch for checkpoints without them"
        )
    check_save_modes(cfg)
    check_lr_flags(cfg)
    check_megatron_flags(cfg)
    check_expert_flags(cfg, dp)
    check_moe_kernels(cfg)
    check_upcycling(cfg)  # --moe-use-upcycling's needs; turns on --no-load-optim/-rng
    check_mtp_flags(cfg)
    if cfg.multi_latent_attention and cfg.ckpt_format != "megart":
        refuse_mla_yarn(
            cfg.rope_type, f"Megatron-LM's checkpoints (--ckpt-format {cfg.ckpt_format})"
        )
    check_document_flags(cfg)
    cfg.gpt_config().check_layout(tp, pp, cfg.chunks, **cfg.stages)  # GPTConfig's refusals
    check_moe_tensor_parallel(cfg.gpt_config(), tp, cfg.sequence_parallel)
    return dp


def _check_virtual_flags(cfg: TrainConfig) -> None:
    """Megatron-LM's two spellings of interleaving: one at a time, chunks at least 1."""
    per, vs = cfg.num_layers_per_virtual_pipeline_stage, cfg.num_virtual_stages_per_pipeline_rank
    if vs is None:
        return
    if per is not None:
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage {per} and "
            f"--num-virtual-stages-per-pipeline-rank {vs} both set interleaving; give one"
        )
    if vs < 1:
        raise ConfigError(f"--num-virtual-stages-per-pipeline-rank {vs} must be at least 1")
    if vs > 1 and cfg.pipeline_schedule in ("1f1b", "zb-h1", "zb-v"):
        raise ConfigError(
            f"--pipeline-schedule {cfg.pipeline_schedule} runs its own chunks: leave out "
            f"--num-virtual-stages-per-pipeline-rank {vs}, or use the interleaved schedule"
        )


def _check_uneven(cfg: TrainConfig) -> None:
    """Uneven stages take interleaving as --num-virtual-stages-per-pipeline-rank only (as
    Megatron-LM), and not zb-v's V; the layer counts are GPTConfig.check_layout's."""
    if not uneven(**cfg.stages):
        return
    given = " / ".join(
        f"--{f.replace('_', '-')} {getattr(cfg, f)}"
        for f in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        if getattr(cfg, f) is not None
    )
    per = cfg.num_layers_per_virtual_pipeline_stage
    if per is not None:
        raise ConfigError(
            f"{given} cannot take --num-layers-per-virtual-pipeline-stage {per} (neither can "
            "Megatron-LM): give interleaving as --num-virtual-stages-per-pipeline-rank (model "
            "chunks per rank) instead"
        )
    if cfg.schedule == "zb-v":
        raise ConfigError(
            f"{given}: --pipeline-schedule zb-v places two equal chunks per rank in a V and "
            "cannot take uneven stages; use 1f1b or zb-h1, or leave them out"
        )


def _check_schedule(cfg: TrainConfig, dp: int) -> None:
    """Refuses --pipeline-schedule combinations that cannot run, saying what would."""
    name, per, pp = cfg.pipeline_schedule, cfg.num_layers_per_virtual_pipeline_stage, cfg.pp
    check_schedule_flags(name, per)
    if (
        name == "interleaved"
        and per is None
        and (cfg.num_virtual_stages_per_pipeline_rank or 1) < 2
    ):
        raise ConfigError(
            "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage "
            "(the layers of each model chunk) or --num-virtual-stages-per-pipeline-rank of at "
            "least 2"
        )
    if cfg.schedule != "zb-v":
        return
    if cfg.num_layers % (2 * pp):
        raise ConfigError(
            f"--pipeline-schedule zb-v splits each pipeline stage into two chunks: "
            f"--num-layers {cfg.num_layers} must be divisible by 2 x pipeline size {pp}; "
            f"use a multiple of {2 * pp} layers, or zb-h1"
        )
    m = cfg.microbatches(dp)
    if m < 2 * pp:
        per_step = cfg.micro_batch_size * dp
        raise ConfigError(
            f"--pipeline-schedule zb-v needs at least 2 x pipeline size = {2 * pp} "
            f"microbatches, got {m} (global batch {cfg.global_batch_size} / (micro batch "
            f"{cfg.micro_batch_size} x data-parallel {dp})); use a global batch of at least "
            f"{2 * pp * per_step}, or zb-h1"
        )


def _check_eval_batch(cfg: TrainConfig, dp: int) -> None:
    """Megatron-LM's --eval-global-batch-size and --eval-micro-batch-size: the batch splits
    into whole microbatches on every data-parallel rank (Megatron asserts it), as many as the
    pipeline schedule runs (the training batch's rules, for the evaluation's forwards)."""
    if cfg.eval_global_batch_size is None and cfg.eval_micro_batch_size is None:
        return
    size, micro = cfg.eval_batch_sizes
    given = f"--eval-global-batch-size {size} and --eval-micro-batch-size {micro}"
    if size < 1 or micro < 1:
        raise ConfigError(f"{given} must be at least 1")
    if size % (micro * dp):
        raise ConfigError(
            f"{given}: the evaluation batch is not divisible by its microbatch x data-parallel "
            f"size {dp} = {micro * dp} (Megatron-LM asserts it); use an evaluation batch of "
            f"{nearest_multiples(size, micro * dp)}"
        )
    m, pp = size // (micro * dp), cfg.pp
    need = {"interleaved": (m % pp, f"a multiple of the pipeline size {pp}"),
            "zb-v": (m < 2 * pp, f"at least 2 x pipeline size = {2 * pp}")}  # fmt: skip
    need = need.get(cfg.schedule)
    if need is not None and need[0]:
        raise ConfigError(
            f"{given} make {m} microbatches per data-parallel rank; --pipeline-schedule "
            f"{cfg.schedule} runs evaluation's forwards on {need[1]}: change the evaluation "
            "batch"
        )


def check_schedule_flags(name: str | None, per: int | None) -> None:
    """Refuses a --pipeline-schedule that is unknown or cannot take
    --num-layers-per-virtual-pipeline-stage ``per`` (megart plan checks this too)."""
    if name is not None and name not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"--pipeline-schedule {name} is not one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    if name in ("1f1b", "zb-h1", "zb-v") and per is not None:
        what = (
            "derives its two chunks from the layers per stage"
            if name == "zb-v"
            else ("runs one model chunk per rank")
        )
        raise ConfigError(
            f"--pipeline-schedule {name} {what}: leave out "
            f"--num-layers-per-virtual-pipeline-stage {per}, or use the interleaved schedule"
        )


def check_virtual_stages(num_layers: int, pp: int, per: int) -> None:
    """--num-layers-per-virtual-pipeline-stage must split the layers evenly over the pipeline
    ranks' chunks; the error lists the values that would."""
    if per >= 1 and num_layers % (pp * per) == 0:
        return
    fits = [v for v in range(1, num_layers // pp + 1) if num_layers % (pp * v) == 0]
    hint = (
        f"values that fit: {', '.join(map(str, fits))}"
        if fits
        else f"--num-layers must be a multiple of {pp}"
    )
    raise ConfigError(
        f"--num-layers {num_layers} is not divisible by pipeline size {pp} x "
        f"--num-layers-per-virtual-pipeline-stage {per}; {hint} (layers per model chunk: each "
        f"of the {pp} pipeline ranks holds num_layers / ({pp} x value) chunks)"
    )
