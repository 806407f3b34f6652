"""The weights of Megatron-LM's distributed checkpoint (``--ckpt-format torch_dist``, its
default), written and read in one process.

A torch_dist iteration directory (``iter_NNNNNNN/``) holds ``metadata.json`` (which backends
wrote it), ``common.pt`` (what is not sharded: ``args``, ``checkpoint_version``,
``iteration``, ...) and a torch.distributed.checkpoint (DCP) store: ``.metadata`` and
``__R_K.distcp`` files. The store is independent of the parallel layout: each tensor is kept
under one key with its global shape, and Megatron-Core's ranks read the slices they own. Its
keys are Megatron-Core's sharded keys (``GPTModel.sharded_state_dict()``,
megart.training.megatron_dist_keys): a layer's parameter is one tensor over all layers
(dimension 0 the layer number; each layer its own key where --moe-layer-freq mixes dense and
MoE layers), an MoE layer's experts one more dimension (the expert number), the layer's norms
are named as Transformer Engine's fused layers name them (``linear_qkv.layer_norm_weight``)
whatever the layer spec (but under multi-latent attention, whose local spec keeps each norm's
own name), and each linear layer (each expert's and MLA projection's too) has an
``_extra_state`` object (None unless it holds fp8 scales).
A whole tensor is the one-rank layout: SwiGLU's fc1 is [gate; up] and q/k/v are grouped per
query group as in the legacy files; only the vocabulary's padding depends on the tensor-parallel
size, so a checkpoint is written for the one it names in its ``args``.

Written: the weights, ``args`` and the iteration (Megatron-LM loads it with --finetune, or
--no-load-optim --no-load-rng). Read: the weights of any torch_dist checkpoint of a GPT, the
rest (optimizer, RNG, scheduler) left unread: whole (convert-checkpoint). megart train's own
saves of its whole training state are megart.training.megatron_dist_train's, and each rank's
read of its slices of any store megart.training.megatron_dist_train_load's.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megart.errors import ConfigError
from megart.models.config import GPTConfig
from megart.training.ckpt_files import iteration_dir
from megart.training.megatron_args import check_args
from megart.training.megatron_dist_keys import extra_state_keys, layer_names, sharded_keys
from megart.training.megatron_files import CHECKPOINT_VERSION, torch_load

METADATA = "metadata.json"
COMMON = "common.pt"
BACKENDS = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
MODEL_KEYS = ("embedding.", "decoder.", "output_layer.")
# What reading a damaged or foreign store raises (DCP's CheckpointException is a BaseException).
UNREADABLE = (OSError, RuntimeError, EOFError, pickle.UnpicklingError, CheckpointException)


def is_dist_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` (an iteration directory) holds a torch_dist checkpoint."""
    path = Path(directory) / METADATA
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("sharded_backend") == "torch_dist"
    except (json.JSONDecodeError, AttributeError):
        return False


def extra_states(layers: Iterable[int], cfg: GPTConfig, output: bool) -> dict[str, list[None]]:
    """The ``_extra_state`` (None: no fp8 scales) of each linear layer (and expert's) of
    ``layers``, and of the untied output layer with ``output``, as Megatron-Core's torch_dist
    strategy stores a ShardedObject: a list of its data, torch.save'd (by DCP's planner here),
    keyed ``key/shard_<offset>_<shape>`` (megart.training.megatron_dist_keys). Megatron-Core's
    load asks for them."""
    out = {key: [None] for layer in layers for key in extra_state_keys(layer, cfg)}
    if output:
        out["output_layer._extra_state/shard_0_1"] = [None]
    return out


def write(
    save_dir: str | os.PathLike,
    iteration: int,
    args: Any,
    model: dict[str, torch.Tensor],
    cfg: GPTConfig,
) -> Path:
    """Writes ``model`` (Megatron-Core's whole state dict, the vocabulary padded as ``args``
    say) with ``args`` as the torch_dist checkpoint of ``iteration`` in ``save_dir``; returns
    its iteration directory. The tracker file is the caller's to write."""
    root = iteration_dir(save_dir, iteration)
    root.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {
        k: v.detach().contiguous() for k, v in sharded_keys(model, cfg).items()
    }
    state.update(extra_states(range(cfg.num_layers), cfg, cfg.untie_embeddings_and_output_weights))
    # One process writes the whole store: no process group, hence no_dist. Not flattened, so
    # that each extra state's list is one object, as Megatron-Core's planner writes it.
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(root),
        planner=dcp.DefaultSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    torch.save(common, root / COMMON)
    (root / METADATA).write_text(json.dumps(BACKENDS))
    return root


def read_common(root: Path) -> dict[str, Any]:
    """``common.pt`` of the torch_dist checkpoint in ``root``."""
    try:
        common = torch_load(root / COMMON)
    except UNREADABLE as e:
        raise ConfigError(f"{root / COMMON} cannot be read as Megatron-LM's ({e})") from e
    if not isinstance(common, dict) or common.get("args") is None:
        raise ConfigError(f"{root / COMMON}: no args; not a Megatron-LM checkpoint")
    check_args(vars(common["args"]), root)
    if (common.get("content_metadata") or {}).get("singleton_local_shards"):
        # Megatron-Core's other keying (each layer, each expert and SwiGLU's halves under keys
        # of their own), which Megatron-LM 0.16 does not write: megart reads the default.
        raise ConfigError(
            f"{root}: saved with singleton_local_shards (each expert and SwiGLU half under its "
            "own key); megart reads Megatron-LM's default keys (singleton_local_shards False)"
        )
    return common


def stored(root: Path) -> dict[str, Any]:
    """What the store in ``root`` holds: each key's metadata (a tensor's global size, dtype
    and chunks, or an object's)."""
    try:
        return dcp.FileSystemReader(root).read_metadata().state_dict_metadata
    except UNREADABLE as e:
        raise ConfigError(f"{root} cannot be read as a torch_dist checkpoint ({e})") from e


def load_store(root: Path, state: dict[str, Any], planner: Any = None) -> None:
    """DCP's load of ``state`` from the store in ``root``, in this process alone."""
    try:
        with warnings.catch_warnings():  # each process reads alone, by design
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            reader = dcp.FileSystemReader(root)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except UNREADABLE as e:
        raise ConfigError(f"{root} cannot be read as a torch_dist checkpoint ({e})") from e


def has_optimizer_state(root: Path) -> bool:
    """Whether the store in ``root`` holds an optimizer's state (Megatron-LM's saves do;
    convert-checkpoint's, weights alone, do not; the distributed optimizer's under expert
    parallelism are its chain's, ``chained_N.optimizer.``)."""
    return any(re.match(r"(chained_\d+\.)?optimizer\.", key) for key in stored(root))


def read(root: Path) -> dict[str, torch.Tensor]:
    """The model's whole tensors in the torch_dist checkpoint in ``root`` (an iteration
    directory), under Megatron-Core's per-layer names; what is not the model's (optimizer,
    RNG states, extra states) is not read."""
    whole = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored(root).items()
        if key.startswith(MODEL_KEYS) and isinstance(meta, dcp.metadata.TensorStorageMetadata)
    }
    if "embedding.word_embeddings.weight" not in whole:
        raise ConfigError(f"{root}: no embedding.word_embeddings.weight; not a GPT's weights")
    load_store(root, whole)
    return layer_names(whole)
