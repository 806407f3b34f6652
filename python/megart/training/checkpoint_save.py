"""Writing megart's checkpoints (the layout megart.training.checkpoint describes): every
rank's part of a training state after an iteration, and a release checkpoint of weights alone.

Atomic: files are written into ``iter_XXXXXXX.partial`` and the directory is renamed only after
every rank has written, then the tracker file is replaced. A crash mid-save leaves the previous
checkpoint as the latest one. One rank's file is ``file_state``'s dict in megart's own format
(--ckpt-format megart), or that dict as Megatron-LM's legacy file holds it (``torch``,
megart.training.megatron_files); --ckpt-format torch_dist writes Megatron-LM's distributed
store instead (megart.training.megatron_dist_train).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

import megart.distributed as dist
from megart.models import GPTChunk, GPTConfig
from megart.models.moe_router import expert_bias_rows
from megart.tensor_parallel.random import GeneratorStates
from megart.training import (
    checkpoint_dirs,
    checksum,
    dist_store,
    megatron_dist_train,
    megatron_distrib_optim,
    megatron_expert_distopt,
    tokenizer_record,
)
from megart.training.ckpt_files import (
    EXPERT_PARALLEL,
    FILE,
    MODEL_FIELDS,
    PARALLEL_FIELDS,
    TRACKER,
    iteration_dir,
    optimizer_params,
    rank_dir,
)
from megart.training.compact_tensors import compact
from megart.training.megatron_files import to_megatron_file
from megart.training.megatron_scheduler import scheduler_state


def _rng_state(rng: Any) -> dict[str, Any]:
    default = GeneratorStates.current()
    return {"torch": default.cpu, "cuda": default.cuda, "tracker": rng.get_states()}


def replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def file_state(
    iteration: int,
    layout: dict[str, Any],
    model_config: dict[str, Any],
    layer_ids: list[list[int]],
    model: list[dict[str, torch.Tensor]],
    optimizer_params: list[tuple[int, str]] | None = None,
    optimizer: dict[str, Any] | None = None,
    rng: dict[str, Any] | None = None,
    loss_scaler: dict[str, Any] | None = None,
    release: bool = False,
    consumed_train_samples: int | None = None,
    tokenizer: dict[str, str] | None = None,
    scheduler: dict[str, Any] | None = None,
    expert_bias: torch.Tensor | None = None,
) -> dict[str, Any]:
    """What one model-parallel rank's file holds (the one definition of the format).
    ``layout``: MODEL_FIELDS and PARALLEL_FIELDS; ``release``: the weights alone (megart
    import-hf), loaded as --finetune loads a checkpoint; ``consumed_train_samples``: the
    samples trained so far (Megatron's name), where --rampup-batch-size resumes its ramp;
    ``tokenizer``: the tokenizer the model was trained with (megart.training.tokenizer_record),
    which export-hf saves beside the weights; ``scheduler``: the learning-rate schedule in
    Megatron's scheduler state (megatron_scheduler.scheduler_state), which
    --use-checkpoint-opt_param-scheduler takes (megart's resumes follow their flags: it is
    not checked against them, as Megatron's formats' is); ``expert_bias``: every layer's
    expert bias (--moe-router-enable-expert-bias; models.moe_router.expert_bias_rows), in
    every file, which any layout reads its own layers' rows from."""
    return {
        "iteration": iteration,
        "consumed_train_samples": consumed_train_samples,
        "release": release,
        "config": layout,
        "model_config": model_config,
        "layer_ids": layer_ids,
        "optimizer_params": optimizer_params or [],
        "model": model,
        "optimizer": optimizer,
        "rng": rng,
        "loss_scaler": loss_scaler,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
        "expert_bias": expert_bias,
    }


def write_file(path: Path, state: dict[str, Any]) -> None:
    """Writes one rank's file; a crash mid-write leaves no partial file under its name. Each
    tensor is written over its own bytes (compact_tensors: the experts' weights under
    --moe-grouped-gemm are views of one stack), so the file is the one separate parameters
    give."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(compact(state), tmp)
    os.replace(tmp, path)
    checksum.write(path)


def begin(directory: str | os.PathLike, iteration: int, persistent: bool = True) -> Path:
    """Every rank, as a save starts: its ``iter_N.partial`` folder, emptied and created by rank
    0 (before a non-persistent save, once the older non-persistent checkpoints but the newest
    are deleted, as Megatron-LM's cleanup does); returns it."""
    final = iteration_dir(directory, iteration)
    partial = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        if not persistent:
            checkpoint_dirs.remove_old_non_persistent(Path(directory))
        shutil.rmtree(partial, ignore_errors=True)  # a crash's leftovers
        partial.mkdir(parents=True)
    dist.barrier()
    return partial


def save(
    directory: str | os.PathLike,
    iteration: int,
    config: Any,
    grid: Any,
    chunks: list[GPTChunk],
    optimizer: torch.optim.Optimizer,
    rng: Any,
    scaler: Any = None,
    consumed_samples: int | None = None,
    persistent: bool = True,
) -> Path:
    """Saves this job's state after ``iteration`` iterations (``consumed_samples`` samples;
    None: iteration x --global-batch-size). Every rank calls it. A non-persistent checkpoint
    (not ``persistent``) is the same, and --save-retain-interval leaves it alone."""
    final = iteration_dir(directory, iteration)
    partial = begin(directory, iteration, persistent)
    retain = config.save_retain_interval if persistent else None
    consumed = (
        iteration * config.global_batch_size if consumed_samples is None else consumed_samples
    )
    if config.ckpt_format == "torch_dist":  # Megatron's distributed store (megatron_dist_train)
        if dist_writer(config, grid):
            state = megatron_dist_train.rank_state(config, grid, chunks, optimizer, rng, scaler)
            dist_store.write_rank(partial, dist.get_rank(), state)
        dist.barrier()
        if dist.get_rank() == 0:
            dp = grid.layout.dp
            common = megatron_dist_train.common_state(
                config, chunks, dp, optimizer, scaler, iteration, consumed
            )
            megatron_dist_train.write_common(partial, common)
        return publish(directory, iteration, partial, final, retain)
    # Every rank (or none, with --no-save-optim): a distributed optimizer gathers its state over
    # data parallelism.
    optimizer_state = None if config.no_save_optim else optimizer.state_dict()
    cfg = chunks[0].cfg
    bias = (  # every stage's layers' rows (all ranks take part)
        expert_bias_rows(chunks, cfg, grid.pp_group, next(chunks[0].parameters()).device)
        if cfg.moe_router_enable_expert_bias
        else None
    )
    # Data- and context-parallel ranks hold the same; under expert parallelism rank 0 of each
    # expert-data-parallel group writes (each expert-parallel rank holds other experts).
    ep_size, ep_rank = getattr(grid, "ep", 1), getattr(grid, "ep_rank", 0)
    if getattr(grid, "edp_rank", grid.dp_cp_rank) == 0:
        ep = {EXPERT_PARALLEL: ep_size} if ep_size > 1 else {}
        state = file_state(
            iteration,
            # context_parallel_size is a record only: the weights' layout does not depend on it.
            layout={f: getattr(config, f) for f in MODEL_FIELDS + PARALLEL_FIELDS}
            | {"pipeline_schedule": config.schedule}
            | {"context_parallel_size": config.context_parallel_size}
            | ep
            | {"vocab_size": int(config.vocab_size)},  # plain (megatron_flags.ResolvedVocabulary)
            model_config=dataclasses.asdict(chunks[0].cfg),
            layer_ids=[list(chunk.layer_ids) for chunk in chunks],
            model=[chunk.state_dict() for chunk in chunks],
            optimizer_params=None if config.no_save_optim else optimizer_params(chunks, optimizer),
            optimizer=optimizer_state,
            rng=None if config.no_save_rng else _rng_state(rng),
            loss_scaler=None if scaler is None or config.no_save_optim else scaler.state_dict(),
            consumed_train_samples=consumed,
            tokenizer=tokenizer_record.record(config),
            scheduler=scheduler_state(config, iteration, consumed),
            expert_bias=bias,
        )
        here = partial / rank_dir(grid.tp_rank, grid.pp_rank, config.pp, ep_rank, ep_size)
        if config.ckpt_format == "torch":  # Megatron-LM's legacy layout (megatron_files)
            state = to_megatron_file(state, config, chunks[0].cfg, grid.layout.dp, ep_rank)
            if config.use_distributed_optimizer and state.get("optimizer") is not None:
                if ep_size > 1:  # the chain's: the dense vectors where dp rank 0 writes
                    dense_writer = grid.dp_cp_rank == 0
                    state, param_state = megatron_expert_distopt.split(
                        state, grid.pp_rank, dense_writer
                    )
                else:
                    state, param_state = megatron_distrib_optim.split(state, grid.pp_rank)
                write_file(here / megatron_distrib_optim.DISTRIB_FILE, param_state)
        write_file(here / FILE, state)
    return publish(directory, iteration, partial, final, retain)


def dist_writer(config: Any, grid: Any) -> bool:
    """Whether this rank writes slices of a torch_dist store: every rank with the distributed
    optimizer (its slices of the moments), else rank 0 of the data x context-parallel ranks,
    which all hold the same, and under expert parallelism rank 0 of the expert-data-parallel
    ranks, which hold the same experts."""
    edp_rank = getattr(grid, "edp_rank", grid.dp_cp_rank)
    return grid.dp_cp_rank == 0 or edp_rank == 0 or config.use_distributed_optimizer


def publish(
    directory: Any, iteration: int, partial: Path, final: Path, retain: int | None = None
) -> Path:
    """Once every rank has written: the iteration's directory renamed into place, then the
    tracker replaced (a crash before leaves the last complete checkpoint the latest); with
    --save-retain-interval ``retain``, the previous checkpoint then removed unless retained."""
    dist.barrier()
    if dist.get_rank() == 0:
        swap_in(directory, iteration, partial, final, retain)
    dist.barrier()
    return final


def swap_in(
    directory: Any, iteration: int, partial: Path, final: Path, retain: int | None = None
) -> None:
    """Rank 0: the complete ``partial`` renamed to ``final``, then the tracker replaced, then
    the previous checkpoint retired (--save-retain-interval ``retain``)."""
    previous = checkpoint_dirs.tracked_iteration(directory)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    replace_text(Path(directory) / TRACKER, f"{iteration}\n")
    checkpoint_dirs.remove_stale_partials(directory, iteration)
    if retain is not None:
        checkpoint_dirs.retire(directory, previous, iteration, retain)


def write_release(
    save_dir: str | os.PathLike,
    cfg: GPTConfig,
    weights: dict[str, torch.Tensor],
    layer_ids: list[int],
    tokenizer: dict[str, str] | None = None,
    expert_bias: torch.Tensor | None = None,
) -> Path:
    """Writes ``weights`` (one chunk's, of the whole model ``cfg``) as a release checkpoint in
    ``save_dir`` (Megatron's term: the weights alone, iteration 0; --load reshards it to any
    layout and starts as --finetune); returns the file. ``expert_bias``: file_state's."""
    files = [((0, 0), weights, layer_ids)]
    return write_release_ranks(save_dir, cfg, 1, 1, files, tokenizer, expert_bias)[0]


def write_release_ranks(
    save_dir: str | os.PathLike,
    cfg: GPTConfig,
    tp: int,
    pp: int,
    files: Iterable[tuple[tuple[int, int], dict[str, torch.Tensor], list[int]]],
    tokenizer: dict[str, str] | None = None,
    expert_bias: torch.Tensor | None = None,
) -> list[Path]:
    """A release checkpoint of ``tp`` x ``pp`` rank files: ``files`` gives each (tensor rank,
    pipeline rank), its one chunk's weights and that chunk's layers, and each is written as
    it comes (so a generator holds one at a time); ``tokenizer``, ``expert_bias`` as
    file_state's. The
    iteration directory appears, and the tracker names it, only once every file is written."""
    layout = {f: getattr(cfg, f) for f in MODEL_FIELDS}
    layout.update(zip(PARALLEL_FIELDS, (tp, pp, None), strict=True))  # no interleaving
    final = iteration_dir(save_dir, 0)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    written = []
    try:
        for (t, p), weights, layer_ids in files:
            state = file_state(
                0,
                layout=layout,
                model_config=dataclasses.asdict(cfg),
                layer_ids=[layer_ids],
                model=[weights],
                release=True,
                tokenizer=tokenizer,
                expert_bias=expert_bias,
            )
            write_file(partial / rank_dir(t, p, pp) / FILE, state)
            written.append(final / rank_dir(t, p, pp) / FILE)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # an earlier checkpoint there stays whole
        raise
    swap_in(save_dir, 0, partial, final)
    return written
