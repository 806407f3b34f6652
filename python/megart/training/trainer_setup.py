"""The steps that build a :class:`~megart.training.trainer.Trainer`, one function each.

``Trainer.__init__`` calls them in a fixed order, and the order is behaviour: the flags are
checked before any rank waits on another, and the random streams are seeded before the weights
are drawn, so that a seed gives the same loss curve. Each step takes what it needs and returns
what it builds, so ``Trainer.__init__`` shows every attribute it sets and where it comes from.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

import megart
import megart.distributed as dist
from megart.errors import ConfigError
from megart.models import pipeline_chunks
from megart.models.moe import MoE
from megart.models.moe_router import set_global_group
from megart.optim.loss_scale import LossScaler
from megart.pipeline import StageLink
from megart.tensor_parallel import RNGStatesTracker, seed_tensor_parallel
from megart.training import checkpoint, checkpoint_dirs, upcycling
from megart.training.data import Dataset, build_datasets, build_split_datasets
from megart.training.dtypes import half_dtype
from megart.training.flops import model_flops
from megart.training.host_random import seed_host_generators
from megart.training.layer_placement import (
    placement,
    replayed_layer_count,
    replayed_moe_layer_count,
)
from megart.training.megatron_blend import megatron_datasets
from megart.training.megatron_flags import mock_tokens
from megart.training.optimizer import full_precision

if TYPE_CHECKING:
    from megart.models import GPTChunk, GPTConfig
    from megart.parallel import ParallelGrid
    from megart.training.config import TrainConfig


def checked_dp_size(config: TrainConfig) -> int:
    """The data-parallel size, once the flags and --save pass their checks. Nothing here waits
    on another rank, so that every rank refuses them alike (and rank 0 alone need say so)."""
    world = dist.get_world_size() if dist.is_initialized() else _launched_world_size()
    dp = config.check(world)
    if config.save:
        checkpoint_dirs.check_writable(config.save)
    return dp


def join_grid(config: TrainConfig, dp: int) -> ParallelGrid:
    """Joins the other ranks (unless the caller already has) and lays them out in the tensor,
    context, pipeline and data-parallel grid, with its process groups: the first wait on other
    ranks."""
    if not dist.is_initialized():
        dist.init(
            backend=config.distributed_backend,
            timeout=timedelta(minutes=config.distributed_timeout_minutes),
        )
    return megart.initialize(
        tp=config.tp,
        pp=config.pp,
        dp=dp,
        backend=config.distributed_backend,
        cp=config.context_parallel_size,
        ep=config.expert_model_parallel_size,
        num_experts=config.num_experts,
    )


def local_device() -> torch.device:
    """The GPU the launcher made current for this rank, or the CPU where there is none."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def seeded_streams(config: TrainConfig, grid: ParallelGrid) -> RNGStatesTracker:
    """The random streams, seeded before any weight is drawn. The replicated stream differs per
    pipeline stage (different layers), the tensor-parallel stream per tensor-parallel rank.
    Python's and numpy's global generators get the stage's seed too."""
    seed = config.seed + 1000 * grid.pp_rank
    rng = RNGStatesTracker()
    seed_tensor_parallel(rng, seed, grid.tp_rank)
    seed_host_generators(seed)  # as Megatron-LM does, for the states its files record
    return rng


def model_chunks(
    config: TrainConfig,
    model_config: GPTConfig,
    grid: ParallelGrid,
    rng: RNGStatesTracker,
    device: torch.device,
) -> list[GPTChunk]:
    """This rank's model chunks (one, or its v interleaved chunks, or ZB-V's two), their weights
    drawn from ``rng``'s streams, on ``device``; with --half-weights rounded to the 16-bit type
    (the parameters only: buffers such as rotary tables stay fp32)."""
    chunks = [
        chunk.to(device)
        for chunk in pipeline_chunks(
            model_config,
            grid.pp_rank,
            tp_group=grid.tp_group,
            sequence_parallel=config.sequence_parallel,
            rng=rng,
            cp_group=grid.cp_group,
            ep_group=grid.ep_group,
            **placement(config),
        )
    ]
    half = half_dtype(config)
    if config.half_weights and half is not None:
        for chunk in chunks:
            for p in chunk.parameters():
                p.data = p.data.to(half)
    if config.moe_grouped_gemm:  # after the casts, before any buffer takes the weights
        for layer in (m for chunk in chunks for m in chunk.modules() if isinstance(m, MoE)):
            layer.group()
    set_global_group(chunks, grid.dp_cp_group)  # global_aux_loss's counts: over every rank
    return chunks


def stage_link(config: TrainConfig, grid: ParallelGrid) -> StageLink:
    """How activations and gradients travel between pipeline stages. Scatter/gather applies to
    tensors replicated across tensor parallelism: with sequence parallelism each rank already
    holds a distinct slice."""
    return StageLink(
        grid.pp_group,
        grid.tp_group,
        config.scatter_gather_tensors_in_pipeline and not config.sequence_parallel,
    )


def activation_shape(config: TrainConfig) -> tuple[int, int, int]:
    """(sequence, microbatch, hidden) of the activation a stage sends on, the pipeline engine's
    buffer shape; context parallelism splits the sequence over the context-parallel ranks,
    sequence parallelism over the tensor-parallel ranks."""
    seq = config.seq_length // config.context_parallel_size
    seq = seq // config.tp if config.sequence_parallel else seq
    return (seq, config.micro_batch_size, config.hidden_size)


def datasets(
    config: TrainConfig, tokens: Any | None, dp: int = 1
) -> tuple[Dataset, Dataset | None, Dataset | None]:
    """The training, validation and test ranges of ``tokens`` (or --mock-data's, or
    --data-path's, or the built-in corpus), or the per-split paths' datasets. The validation
    range is evaluated every --eval-interval iterations, the test range once at the end (none
    without --eval-iters)."""
    if config.data_order == "megatron":  # Megatron's samples, sliced as its sampler (dp)
        if tokens is not None:
            raise ConfigError("--data-order megatron reads --data-path's files, not given tokens")
        return megatron_datasets(config, dp)
    per_split = (config.train_data_path, config.valid_data_path, config.test_data_path)
    if tokens is None and any(per_split):
        return build_split_datasets(
            per_split,
            config.seq_length,
            config.vocab_size,
            evaluate=config.eval_iters > 0,
            mmap=config.mmap_bin_files,
        )
    if tokens is None and config.mock_data:
        tokens = mock_tokens(config)
    return build_datasets(
        config.data_path,
        config.split,
        config.seq_length,
        config.vocab_size,
        tokens,
        evaluate=config.eval_iters > 0,
        mmap=config.mmap_bin_files,
    )


def flop_counts(config: TrainConfig, model_config: GPTConfig) -> tuple[int, int]:
    """The FLOPs of a full global batch: the model's, which MFU counts as its definition says,
    and what runs, which TFLOP/s count (Megatron's causal count, plus the forward again of the
    layers full recomputation replays: all of them, or under --recompute-method block the first
    --recompute-num-layers of each model chunk, summed over every pipeline rank's chunks; and
    under --recompute-modules mlp every layer's MLP forward)."""
    batch, full = config.global_batch_size, model_config.recompute_granularity == "full"
    model = model_flops(model_config, batch, tp=config.tp)
    replayed = replayed_layer_count(config, model_config)
    run = model_flops(
        model_config,
        batch,
        recompute=full,
        tp=config.tp,
        replayed=replayed,
        mlp_again=model_config.recomputes("mlp"),
        replayed_moe=replayed_moe_layer_count(config, model_config),
    )
    return model, run


def loss_scaler(config: TrainConfig) -> LossScaler | None:
    """fp16's loss scaler (static under --loss-scale, dynamic otherwise); bf16 and fp32 need
    none, since their range holds the gradients."""
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        # A static --loss-scale never updates: the dynamic flags do not apply (Megatron's
        # ConstantGradScaler), so they are not passed.
        return LossScaler(init_scale=config.loss_scale)
    return LossScaler(
        init_scale=config.initial_loss_scale,
        growth_interval=config.loss_scale_window,
        min_scale=config.min_loss_scale,
        hysteresis=config.hysteresis,
    )


def resume_point(
    config: TrainConfig,
    grid: ParallelGrid,
    chunks: list[GPTChunk],
    optimizer: torch.optim.Optimizer,
    rng: RNGStatesTracker,
    scaler: LossScaler | None,
) -> tuple[int, int]:
    """The iterations already done and the samples consumed (Megatron's
    consumed_train_samples): (0, 0) for a fresh run, else --load's checkpoint's, restored into
    ``chunks``, ``optimizer``, ``rng`` and ``scaler`` so the run continues the same curve.
    Where --load holds none and --pretrained-checkpoint is given, that one's weights."""
    if config.moe_use_upcycling:  # --load's dense checkpoint, its MLPs made experts
        return upcycling.start(config, grid, chunks, optimizer, rng, scaler, model_chunks)
    start = pretrained_start(config)
    if start is not None:
        with full_precision(optimizer):
            return checkpoint.load(start.load, start, grid, chunks, optimizer, rng, scaler)
    # --load, or its non-persistent checkpoints' directory where those are newer.
    load = checkpoint_dirs.resume_dir(config)
    if load and checkpoint_dirs.no_checkpoint_yet(load):
        if config.exit_on_missing_checkpoint:
            raise ConfigError(
                f"--load {config.load} holds no checkpoint and --exit-on-missing-checkpoint is "
                "given: point --load at a directory that megart train --save (or Megatron-LM) "
                "wrote, or leave the flag out to start from scratch"
            )
        # A restartable job line (--save X --load X) on its first run, as Megatron does.
        if dist.get_rank() == 0:
            print(
                f"megart train: --load {config.load} holds no checkpoint yet: "
                "starting from scratch",
                flush=True,
            )
    elif load:
        if load != config.load and dist.get_rank() == 0:
            print(f"megart train: resuming from the non-persistent checkpoint in {load}")
        # megart's files or Megatron-LM's legacy ones (read as megart's: megatron_file_read), into
        # fp32 weights (with --half-weights the optimizer's main weights).
        with full_precision(optimizer):
            return checkpoint.load(load, config, grid, chunks, optimizer, rng, scaler)
    return 0, 0


def pretrained_start(config: TrainConfig) -> TrainConfig | None:
    """Megatron-LM's fine-tuning start: where --pretrained-checkpoint is given and --load holds
    no checkpoint (or is not given), the config that loads the pretrained one's weights, from
    iteration 0, as --finetune; None otherwise (--load's own checkpoint wins, so a restarted
    job resumes what it saved)."""
    pretrained = config.pretrained_checkpoint
    if not checkpoint_dirs.loads_pretrained(checkpoint_dirs.resume_dir(config), pretrained):
        return None
    if checkpoint_dirs.no_checkpoint_yet(pretrained):
        raise ConfigError(
            f"--pretrained-checkpoint {pretrained} holds no checkpoint"
            + (f" (nor does --load {config.load})" if config.load else "")
            + ": point it at a directory that megart train --save, import-hf or Megatron-LM "
            "wrote"
        )
    if dist.get_rank() == 0:
        held = f"--load {config.load} holds no checkpoint yet" if config.load else "no --load"
        print(f"megart train: {held}: fine-tuning from --pretrained-checkpoint {pretrained}")
    start = copy.copy(config)  # not dataclasses.replace: the flags are resolved already
    start.load, start.finetune = pretrained, True
    return start


def _launched_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 without it); init() checks it further."""
    value = os.environ.get("WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1
