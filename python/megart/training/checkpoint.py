"""Checkpoints in Megatron-LM's layout, written atomically, with everything resume needs.

    <dir>/latest_checkpointed_iteration.txt          the last complete checkpoint
    <dir>/iter_0000100/mp_rank_00/model_optim_rng.pt         (pipeline size 1)
    <dir>/iter_0000100/mp_rank_00_001/model_optim_rng.pt     (tensor rank 0, pipeline rank 1)

One file per model-parallel rank, written by data-parallel rank 0 of it (data-parallel ranks
hold the same weights, optimizer state and random states). Each holds this rank's model chunks,
the optimizer state, the random streams, the fp16 loss scale, the iteration and the samples
consumed, so a resumed run continues the same loss curve: the data is a function of the
iteration, the learning rate and --rampup-batch-size's batch of the consumed samples. It
also holds the model's whole GPTConfig, each chunk's layer ids and the parameter each
optimizer state belongs to, so that the files can be merged into one model without the
training flags (megart.training.shards): megart.training.export_hf writes it out, and ``load``
reshards a checkpoint of another tensor/pipeline layout (megart.training.reshard). Checkpoints
from before those were saved hold a GPT-2-architecture model (the Trainer built no other) and
the Trainer's optimizer order.

Atomic: files are written into ``iter_XXXXXXX.partial`` and the directory is renamed only after
every rank has written, then the tracker file is replaced. A crash mid-save leaves the previous
checkpoint as the latest one.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch

import megart.distributed as dist
from megart.errors import ConfigError
from megart.models import GPTChunk, GPTConfig
from megart.models.config import architecture_flags
from megart.tensor_parallel.random import GeneratorStates
from megart.training import (
    checkpoint_dirs,
    checksum,
    megatron_dist,
    megatron_dist_train,
    megatron_distrib_optim,
    reshard,
)
from megart.training.ckpt_files import (  # re-exported: checkpoint.FILE etc. as before
    FILE,
    MODEL_FIELDS,
    PARALLEL_FIELDS,
    TRACKER,
    in_live_order,
    iteration_dir,
    latest_iteration,
    optimizer_params,
    rank_dir,
    read_file,
    required_latest_iteration,
)
from megart.training.megatron_args import args_record
from megart.training.megatron_files import to_megatron_file
from megart.training.megatron_scheduler import check_scheduler


def _check_placement(directory: str | os.PathLike, saved: dict, config: Any) -> None:
    """zb-v places its chunks in a V, which resharding does not know: such a checkpoint loads
    only into the same layout and schedule."""
    was = saved.get("pipeline_schedule", "1f1b")  # saved before schedules were recorded
    same = all(saved[f] == getattr(config, f) for f in PARALLEL_FIELDS)
    if (was == "zb-v") != (config.schedule == "zb-v") or (
        "zb-v" in (was, config.schedule) and not same
    ):
        raise ConfigError(
            f"--load {directory} was saved with --pipeline-schedule {was} and this run uses "
            f"{config.schedule}; a zb-v checkpoint loads only into zb-v with the same tensor- "
            "and pipeline-parallel sizes (resharding it is not supported)"
        )


__all__ = [
    "FILE",
    "MODEL_FIELDS",
    "PARALLEL_FIELDS",
    "TRACKER",
    "iteration_dir",
    "latest_iteration",
    "load",
    "model_config",
    "optimizer_params",
    "rank_dir",
    "read_file",
    "required_latest_iteration",
    "save",
]


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
) -> dict[str, Any]:
    """What one model-parallel rank's file holds (the one definition of the format).
    ``layout``: MODEL_FIELDS and PARALLEL_FIELDS; ``release``: the weights alone (megart
    import-hf), loaded as --finetune loads a checkpoint; ``consumed_train_samples``: the
    samples trained so far (Megatron's name), where --rampup-batch-size resumes its ramp."""
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
    }


def write_file(path: Path, state: dict[str, Any]) -> None:
    """Writes one rank's file; a crash mid-write leaves no partial file under its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    checksum.write(path)


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
) -> Path:
    """Saves this job's state after ``iteration`` iterations (``consumed_samples`` samples;
    None: iteration x --global-batch-size). Every rank calls it."""
    final = iteration_dir(directory, iteration)
    partial = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a crash's leftovers
        partial.mkdir(parents=True)
    dist.barrier()
    consumed = (
        iteration * config.global_batch_size if consumed_samples is None else consumed_samples
    )
    if config.ckpt_format == "torch_dist":  # Megatron's distributed store (megatron_dist_train)
        # With the distributed optimizer every rank writes its slices of the moments.
        if grid.dp_rank == 0 or config.use_distributed_optimizer:
            rank = dist.get_rank()
            megatron_dist_train.write_rank(
                partial, rank, config, grid, chunks, optimizer, rng, scaler
            )
        dist.barrier()
        if dist.get_rank() == 0:
            megatron_dist_train.finish(
                partial, config, chunks, grid.layout.dp, optimizer, scaler, iteration, consumed
            )
        return _publish(directory, iteration, partial, final)
    # Every rank: a distributed optimizer gathers its state over data parallelism.
    optimizer_state = optimizer.state_dict()
    if grid.dp_rank == 0:
        state = file_state(
            iteration,
            layout={f: getattr(config, f) for f in MODEL_FIELDS + PARALLEL_FIELDS}
            | {"pipeline_schedule": config.schedule},
            model_config=dataclasses.asdict(chunks[0].cfg),
            layer_ids=[list(chunk.layer_ids) for chunk in chunks],
            model=[chunk.state_dict() for chunk in chunks],
            optimizer_params=optimizer_params(chunks, optimizer),
            optimizer=optimizer_state,
            rng=_rng_state(rng),
            loss_scaler=scaler.state_dict() if scaler is not None else None,
            consumed_train_samples=consumed,
        )
        here = partial / rank_dir(grid.tp_rank, grid.pp_rank, config.pp)
        if config.ckpt_format == "torch":  # Megatron-LM's legacy layout (megatron_files)
            state = to_megatron_file(state, config, chunks[0].cfg, grid.layout.dp)
            if config.use_distributed_optimizer and state.get("optimizer") is not None:
                state, param_state = megatron_distrib_optim.split(state, grid.pp_rank)
                write_file(here / megatron_distrib_optim.DISTRIB_FILE, param_state)
        write_file(here / FILE, state)
    return _publish(directory, iteration, partial, final)


def _publish(directory: Any, iteration: int, partial: Path, final: Path) -> Path:
    """Once every rank has written: the iteration's directory renamed into place, then the
    tracker replaced (a crash before leaves the last complete checkpoint the latest)."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        replace_text(Path(directory) / TRACKER, f"{iteration}\n")
        checkpoint_dirs.remove_stale_partials(directory, iteration)
    dist.barrier()
    return final


def load(
    directory: str | os.PathLike,
    config: Any,
    grid: Any,
    chunks: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    rng: Any,
    scaler: Any = None,
) -> tuple[int, int]:
    """Restores the last complete checkpoint in ``directory`` into the model chunks, the
    optimizer (and fp16 loss scaler) and the random streams; returns the iteration to continue
    from and the samples consumed by then (iterations x --global-batch-size for checkpoints
    saved before they were recorded, as Megatron assumes). ``config.no_load_optim`` and
    ``config.no_load_rng`` skip those parts; with ``config.finetune`` only the weights are
    loaded and the run starts at iteration 0, as Megatron's flags. A checkpoint of another
    tensor/pipeline layout is resharded (see megart.training.reshard), keeping this run's own
    random streams; a directory without a checkpoint, or a checkpoint of another model, is a
    ConfigError naming the flags."""
    iteration = required_latest_iteration(directory, ", or leave --load out to start from scratch")
    root = iteration_dir(directory, iteration)
    if megatron_dist.is_dist_checkpoint(root):
        return _load_dist(directory, root, config, grid, chunks, optimizer, rng, scaler)
    own = root / rank_dir(grid.tp_rank, grid.pp_rank, config.pp) / FILE
    found = sorted(root.glob(f"mp_rank_*/{FILE}"))
    if not found:
        raise ConfigError(f"--load {directory}: {root} holds no mp_rank_*/{FILE}")
    # Any file tells the layout, the iteration and the loss scale (the same in every file).
    state = read_file(own if own.exists() else found[0])
    _check_model(directory, state, config, chunks[0].cfg)
    # A release checkpoint (megart import-hf) holds weights only and is loaded as --finetune.
    finetune = config.finetune or bool(state.get("release"))
    load_optim = not (finetune or config.no_load_optim)
    load_rng = not (finetune or config.no_load_rng)
    _check_placement(directory, state["config"], config)
    if load_optim and state.get("opt_param_scheduler") is not None:  # written by Megatron-LM
        check_scheduler(state["opt_param_scheduler"], config, directory)
    if any(state["config"][f] != getattr(config, f) for f in PARALLEL_FIELDS):
        reshard.restore(
            root, state["config"], config, grid, chunks, optimizer if load_optim else None
        )
        if dist.get_rank() == 0:
            print(reshard.describe(directory, iteration, state["config"], config), flush=True)
    else:
        if not own.exists():
            raise ConfigError(f"--load {directory}: {own} is missing")
        for chunk, sd in zip(chunks, state["model"], strict=True):
            chunk.load_state_dict(sd)
        if load_optim:
            saved = state["optimizer"]
            params = state["optimizer_params"]
            optimizer.load_state_dict(in_live_order(saved, params, chunks, optimizer, directory))
        if load_rng and state["rng"] is not None:
            r = state["rng"]
            GeneratorStates(r["torch"], r["cuda"]).install()
            if r["tracker"] is not None:  # None: Megatron-LM's (CUDA) streams, not taken
                rng.set_states(r["tracker"])
    if load_optim and scaler is not None and state.get("loss_scaler") is not None:
        scaler.load_state_dict(state["loss_scaler"])
    if finetune:
        return 0, 0
    return _resume_point(int(state["iteration"]), state.get("consumed_train_samples"), config)


def _load_dist(
    directory: Any,
    root: Path,
    config: Any,
    grid: Any,
    chunks: list[torch.nn.Module],
    optimizer: Any,
    rng: Any,
    scaler: Any,
) -> tuple[int, int]:
    """--load of a torch_dist store (Megatron-LM's, or megart train's --ckpt-format
    torch_dist) into any layout, zb-v's included (the store holds whole tensors by layer):
    see megart.training.megatron_dist_train.load. One of weights alone (convert-checkpoint's)
    loads as --finetune, like a release checkpoint."""
    common = megatron_dist.read_common(root)
    a = vars(common["args"])
    state = args_record(a)
    extra = common.get("megart")
    if isinstance(extra, dict) and extra.get("model_config") is not None:
        state["model_config"] = extra["model_config"]  # megart's own: every field
    _check_model(directory, state, config, chunks[0].cfg)
    finetune = config.finetune or not megatron_dist.has_optimizer_state(root)
    load_optim = not (finetune or config.no_load_optim)
    load_rng = not (finetune or config.no_load_rng)
    left_out = megatron_dist_train.load(
        root, common, config, grid, chunks, optimizer, rng, scaler, load_optim, load_rng, directory
    )
    if dist.get_rank() == 0:
        what = "the weights" + (", the optimizer" if load_optim else "")
        print(
            f"loaded {what} of {root} (torch_dist) into tensor-parallel {config.tp}, "
            f"pipeline-parallel {config.pp}{left_out}",
            flush=True,
        )
    if finetune:
        return 0, 0
    return _resume_point(int(common["iteration"]), a.get("consumed_train_samples"), config)


def _resume_point(iteration: int, consumed: Any, config: Any) -> tuple[int, int]:
    """The iteration to go on from and the samples consumed by then (iterations x
    --global-batch-size where the checkpoint did not record them, as Megatron assumes)."""
    return iteration, iteration * config.global_batch_size if consumed is None else int(consumed)


def model_config(state: dict[str, Any]) -> GPTConfig:
    """The GPTConfig of the model a checkpoint file belongs to."""
    saved = state.get("model_config")
    if saved is None:
        # Saved before checkpoints held the model's config: the Trainer then built GPT-2's
        # architecture with GPTConfig's defaults and these sizes, and nothing else.
        layout = state["config"]
        sizes = ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads")
        return GPTConfig(**{k: layout[k] for k in sizes})
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    fields = {k: v for k, v in saved.items() if k in known}
    # Saved before the config recorded the rotation: megart then rotated adjacent pairs.
    fields.setdefault("rotary_interleaved", True)
    return GPTConfig(**fields)


def _check_model(directory: Any, state: dict[str, Any], config: Any, cfg: Any) -> None:
    """Refuses a checkpoint of another model, naming each flag (or GPTConfig field) that
    differs: its weights cannot be resharded into this one."""
    saved = state["config"]
    differ = [
        f"--{f.replace('_', '-')} {saved[f]} (now {getattr(config, f)})"
        for f in MODEL_FIELDS
        if saved[f] != getattr(config, f) and not (f == "vocab_size" and saved[f] is None)
    ]
    if saved["vocab_size"] is None:  # Megatron-LM's, its tokenizer's size unrecorded
        t = saved["tensor_model_parallel_size"]
        if saved["padded_vocab_size"] != cfg.padded_vocab_size(t):
            differ.append(
                f"a vocabulary padded to {saved['padded_vocab_size']} rows for "
                f"tensor-parallel {t} (--vocab-size {config.vocab_size} pads to "
                f"{cfg.padded_vocab_size(t)})"
            )
    # The architecture flags that shape the weights or what they mean, beyond MODEL_FIELDS;
    # the rest (dropout, seed, --init-method-std, fused kernels, recomputation) may change.
    was, now = architecture_flags(model_config(state)), architecture_flags(cfg)
    differ += [f"{was[f]} (now {now[f]})" for f in was if was[f] != now[f]]
    if differ:
        raise ConfigError(
            f"--load {directory}: the checkpoint was saved with " + ", ".join(differ) + "; "
            "a checkpoint of another model cannot be resharded (only the tensor- and "
            "pipeline-parallel layout may change), so resume with the saved values"
        )


def write_release(
    save_dir: str | os.PathLike,
    cfg: GPTConfig,
    weights: dict[str, torch.Tensor],
    layer_ids: list[int],
) -> Path:
    """Writes ``weights`` (one chunk's, of the whole model ``cfg``) as a release checkpoint in
    ``save_dir`` (Megatron's term: the weights alone, one rank's file, iteration 0; --load
    reshards it to any layout and starts as --finetune); returns the file."""
    layout = {f: getattr(cfg, f) for f in MODEL_FIELDS}
    layout.update(zip(PARALLEL_FIELDS, (1, 1, None), strict=True))  # tp 1, pp 1, no interleaving
    state = file_state(
        0,
        layout=layout,
        model_config=dataclasses.asdict(cfg),
        layer_ids=[layer_ids],
        model=[weights],
        release=True,
    )
    out = iteration_dir(save_dir, 0) / rank_dir(0, 0, 1) / FILE
    write_file(out, state)
    replace_text(Path(save_dir) / TRACKER, "0\n")
    return out
