"""The files of a checkpoint directory and what every reader of them needs: the names, the
tracker, reading one rank's file. checkpoint (save and load), shards (merging the files) and
reshard (loading under another layout) all build on this module and not on each other's
internals, so that none of them imports another in a cycle."""

from __future__ import annotations

import os
import pickle
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.training import checksum, megatron_expert_distopt
from megart.training.megatron_file_read import from_megatron_file
from megart.training.megatron_files import is_megatron_file, torch_load
from megart.training.norm_biases import add_zero_norm_biases

# read_file's key for the LayerNorm biases it added (megart.training.norm_biases), not saved.
NORM_BIASES_ADDED = "norm_biases_added"

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
# Saved with the checkpoint and compared on load. The model's sizes must match; the parallel
# layout may differ (then the checkpoint is resharded).
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
PARALLEL_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
)


def iteration_dir(directory: str | os.PathLike, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """A rank's folder; under expert parallelism (``ep`` > 1) each expert-parallel rank has
    its own, suffixed with its rank as Megatron-LM's get_checkpoint_name does."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep == 1 else f"{name}_{ep_rank:03d}"


# The saved layout's key for the expert-parallel size, written only where it is above 1.
EXPERT_PARALLEL = "expert_model_parallel_size"


def saved_expert_parallel(state: dict[str, Any]) -> int:
    """The expert-parallel size a rank's file was saved at (1: every expert in every file)."""
    return int(state["config"].get(EXPERT_PARALLEL) or 1)


def rank_files(root: Path, tp: int, pp: int) -> dict[tuple[int, int], Path]:
    """Every (tensor, pipeline) rank's file of checkpoint ``root`` of ``tp`` x ``pp`` ranks;
    a missing one is a ConfigError naming them all."""
    return {(t, p): path for (t, p, _), path in expert_rank_files(root, tp, pp, 1).items()}


def expert_rank_files(root: Path, tp: int, pp: int, ep: int) -> dict[tuple[int, int, int], Path]:
    """Every (tensor, pipeline, expert-parallel) rank's file of checkpoint ``root`` of ``tp`` x
    ``pp`` x ``ep`` ranks (``ep`` 1: rank_files' files); a missing one is a ConfigError naming
    them all."""
    paths = {
        (t, p, e): root / rank_dir(t, p, pp, e, ep) / FILE
        for t in range(tp)
        for p in range(pp)
        for e in range(ep)
    }
    missing = [str(path) for path in paths.values() if not path.is_file()]
    if missing:
        ranks = f" x expert-parallel {ep}" if ep > 1 else ""
        raise ConfigError(
            f"{root} was saved by tensor-parallel {tp} x pipeline-parallel {pp}{ranks} ranks, "
            f"but {len(missing)} of its {len(paths)} files are missing: {', '.join(missing)}; "
            "copy the whole iteration directory the training job wrote"
        )
    return paths


def latest_iteration(directory: str | os.PathLike) -> int | None:
    """The iteration of the last complete checkpoint in ``directory``, or None."""
    tracker = Path(directory) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"{tracker} holds {text!r}, not an iteration number")
    return int(text)


def required_latest_iteration(directory: str | os.PathLike, otherwise: str = "") -> int:
    """latest_iteration for --load: a directory without a checkpoint is a ConfigError, ending
    with ``otherwise`` (what else the user may do)."""
    iteration = latest_iteration(directory)
    if iteration is None:
        raise ConfigError(
            f"--load {directory}: no {TRACKER} there; point --load at a directory that "
            f"megart train --save wrote{otherwise}"
        )
    return iteration


def chosen_iteration(
    directory: str | os.PathLike, iteration: int | None, flag: str, otherwise: str = ""
) -> int:
    """The iteration of ``directory``'s checkpoint to read: ``iteration`` (given by ``flag``,
    refused naming the ones there when there is none of it), or the latest (none is refused
    as required_latest_iteration refuses it, ending with ``otherwise``)."""
    if iteration is None:
        return required_latest_iteration(directory, otherwise)
    if not iteration_dir(directory, iteration).is_dir():
        saved = sorted(p.name for p in Path(directory).glob("iter_*") if p.is_dir())
        raise ConfigError(
            f"--load {directory} has no checkpoint of iteration {iteration} (it holds "
            f"{', '.join(saved) or 'none'}); pass one of those, or leave {flag} out "
            "for the latest"
        )
    return iteration


def optimizer_params(
    chunks: list[torch.nn.Module], optimizer: torch.optim.Optimizer
) -> list[tuple[int, str]]:
    """(chunk, parameter name) of each parameter of ``optimizer``, in the order its state_dict
    numbers them (param group by param group): what maps its states to the model's."""
    names = {id(p): (c, n) for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def in_live_order(
    saved: dict[str, Any],
    saved_params: list[tuple[int, str]],
    chunks: list[torch.nn.Module],
    optimizer: Any,
    where: Any,
) -> dict[str, Any]:
    """The optimizer state dict ``saved`` (its parameters named by ``saved_params``, in its
    numbering) renumbered as ``optimizer`` numbers the same parameters of ``chunks``: files in
    Megatron's layout list them in another order than megart's optimizer."""
    live = optimizer_params(chunks, optimizer)
    saved_params = [(int(c), str(n)) for c, n in saved_params]
    ours, theirs = len(optimizer.param_groups), len(saved["param_groups"])
    if ours != theirs:  # before anything else: torch's load would say only that they differ
        raise ConfigError(
            f"--load {where}: the saved optimizer state has {theirs} param groups and this "
            f"run's optimizer {ours} (--decoupled-lr adds one, for the embedding and output "
            "layer): resume with the optimizer flags it was saved with, or with --no-load-optim "
            "(fresh optimizer state)"
        )
    if not saved_params or saved_params == live:
        return saved
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    group_of = {i: g for g, group in enumerate(saved["param_groups"]) for i in group["params"]}
    index = dict(zip(saved_params, ids, strict=True))
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    numbers = [
        list(range(start - n, start)) for n, start in zip(sizes, accumulate(sizes), strict=True)
    ]
    place = {j: g for g, group in enumerate(numbers) for j in group}
    if (
        set(index) != set(live)
        or len(numbers) != len(saved["param_groups"])
        or any(group_of[index[p]] != place[j] for j, p in enumerate(live))
    ):
        raise ConfigError(
            f"--load {where}: the saved optimizer state does not hold this model's parameters "
            "in its param groups; resume with --no-load-optim (fresh optimizer state)"
        )
    return {
        "state": {
            j: saved["state"][index[p]] for j, p in enumerate(live) if index[p] in saved["state"]
        },
        "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
            for group, mine in zip(saved["param_groups"], numbers, strict=True)
        ],
    }


def read_file(path: Path) -> dict[str, Any]:
    """One checkpoint file. weights_only: the files hold only tensors, numbers, strings and
    containers, and checkpoints come from elsewhere. mmap: only the pages of the tensors used
    are read (an exporter skips the optimizer's; a resharding rank reads its own parameters').
    Its checksum, where the save wrote one, is verified first (corrupted bytes name the file)."""
    checksum.verify(path)
    try:
        # Allowed besides: what a file in Megatron's layout holds (--ckpt-format torch).
        state = torch_load(path, mmap=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise ConfigError(f"{path} cannot be read as a megart checkpoint file ({e})") from e
    if is_megatron_file(state):  # with the distributed optimizer's distrib_optim.pt joined
        state = from_megatron_file(megatron_expert_distopt.join(state, path), path)
    if not isinstance(state, dict) or "config" not in state or "model" not in state:
        raise ConfigError(f"{path} is not a megart checkpoint file (no 'config' and 'model')")
    # An older megart's LayerNorm without its bias under --disable-bias-linear: zero biases.
    state[NORM_BIASES_ADDED] = add_zero_norm_biases(state)
    return state
