"""Checkpoints in Megatron-LM's layout, written atomically, with everything resume needs.

    <dir>/latest_checkpointed_iteration.txt          the last complete checkpoint
    <dir>/iter_0000100/mp_rank_00/model_optim_rng.pt         (pipeline size 1)
    <dir>/iter_0000100/mp_rank_00_001/model_optim_rng.pt     (tensor rank 0, pipeline rank 1)

One file per model-parallel rank, written by data-parallel rank 0 of it (data-parallel ranks
hold the same weights, optimizer state and random states). Each holds this rank's model chunks,
the optimizer state, the random streams, the fp16 loss scale and the iteration, so a resumed
run continues the same loss curve: the data and the learning rate are functions of the
iteration. It also holds the model's whole GPTConfig and each chunk's layer ids, so that
the files can be merged into one model without the training flags (megart.training.shards,
which megart.training.export_hf uses; checkpoints from before those two were saved hold a
GPT-2-architecture model: the Trainer built no other).

Atomic: files are written into ``iter_XXXXXXX.partial`` and the directory is renamed only after
every rank has written, then the tracker file is replaced. A crash mid-save leaves the previous
checkpoint as the latest one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

import megart.distributed as dist
from megart.errors import ConfigError
from megart.models import GPTChunk
from megart.tensor_parallel.random import GeneratorStates

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
# Saved with the checkpoint and compared on load: resuming under another layout or another
# model would need resharding, which megart does not do.
LAYOUT_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
)


def iteration_dir(directory: str | os.PathLike, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def latest_iteration(directory: str | os.PathLike) -> int | None:
    """The iteration of the last complete checkpoint in ``directory``, or None."""
    tracker = Path(directory) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"{tracker} holds {text!r}, not an iteration number")
    return int(text)


def _rng_state(rng: Any) -> dict[str, Any]:
    default = GeneratorStates.current()
    return {"torch": default.cpu, "cuda": default.cuda, "tracker": rng.get_states()}


def read_file(path: Path) -> dict[str, Any]:
    """One checkpoint file. weights_only: the files hold only tensors, numbers, strings and
    containers, and checkpoints come from elsewhere. mmap: only the pages of the tensors used
    are read (an exporter skips the optimizer's)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise ConfigError(f"{path} cannot be read as a megart checkpoint file ({e})") from e
    if not isinstance(state, dict) or "config" not in state or "model" not in state:
        raise ConfigError(f"{path} is not a megart checkpoint file (no 'config' and 'model')")
    return state


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(
    directory: str | os.PathLike,
    iteration: int,
    config: Any,
    grid: Any,
    chunks: list[GPTChunk],
    optimizer: torch.optim.Optimizer,
    rng: Any,
    scaler: Any = None,
) -> Path:
    """Saves this job's state after ``iteration`` iterations. Every rank calls it."""
    final = iteration_dir(directory, iteration)
    partial = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a crash's leftovers
        partial.mkdir(parents=True)
    dist.barrier()
    if grid.dp_rank == 0:
        state = {
            "iteration": iteration,
            "config": {f: getattr(config, f) for f in LAYOUT_FIELDS},
            "model_config": dataclasses.asdict(chunks[0].cfg),
            "layer_ids": [list(chunk.layer_ids) for chunk in chunks],
            "model": [chunk.state_dict() for chunk in chunks],
            "optimizer": optimizer.state_dict(),
            "rng": _rng_state(rng),
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
        }
        out = partial / rank_dir(grid.tp_rank, grid.pp_rank, config.pp) / FILE
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, out)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _replace_text(Path(directory) / TRACKER, f"{iteration}\n")
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
) -> int:
    """Restores the last complete checkpoint in ``directory`` into the model chunks, the
    optimizer and the random streams; returns its iteration. A directory without a checkpoint,
    or a checkpoint of another model or layout, is a ConfigError."""
    iteration = latest_iteration(directory)
    if iteration is None:
        raise ConfigError(
            f"--load {directory}: no {TRACKER} there; point --load at a directory that "
            "--save wrote, or leave --load out to start from scratch"
        )
    path = iteration_dir(directory, iteration) / rank_dir(grid.tp_rank, grid.pp_rank, config.pp)
    if not (path / FILE).exists():
        raise ConfigError(f"--load {directory}: {path / FILE} is missing")
    state = torch.load(path / FILE, map_location="cpu", weights_only=False)
    saved, now = state["config"], {f: getattr(config, f) for f in LAYOUT_FIELDS}
    differ = [
        f"--{f.replace('_', '-')} {saved[f]} (now {now[f]})" for f in now if saved[f] != now[f]
    ]
    if differ:
        raise ConfigError(
            f"--load {directory}: the checkpoint was saved with " + ", ".join(differ) + "; "
            "megart does not reshard checkpoints, so resume with the saved values"
        )
    for chunk, sd in zip(chunks, state["model"], strict=True):
        chunk.load_state_dict(sd)
    optimizer.load_state_dict(state["optimizer"])
    r = state["rng"]
    GeneratorStates(r["torch"], r["cuda"]).install()
    rng.set_states(r["tracker"])
    if scaler is not None and state.get("loss_scaler") is not None:
        scaler.load_state_dict(state["loss_scaler"])
    return int(state["iteration"])
