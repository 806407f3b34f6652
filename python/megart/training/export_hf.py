"""Offline export of a training checkpoint to a Hugging Face GPT-2 directory, in one process.

    export_checkpoint("ckpt", "gpt2-out")  # megart export-hf --load ckpt --output gpt2-out

Reads every model-parallel file of one checkpoint (``iter_N/mp_rank_TT[_PPP]/``, see
megart.training.checkpoint) with no process group. Each parameter's tensor-parallel shards are
concatenated along the dimension its module split it on, the pipeline chunks' layers are put
back in place by their layer ids (chunk c of pipeline rank r is virtual stage c * p + r), and
the whole model goes through the same GPT-2 conversion as ``GPT.save_hf_gpt2``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models import GPTChunk, GPTConfig, chunk_layers
from megart.models.hf import check_gpt2, gpt2_tensors, write_gpt2
from megart.training.checkpoint import FILE, TRACKER, iteration_dir, latest_iteration, rank_dir

Shards = dict[tuple[int, int], dict[str, Any]]  # (tensor rank, pipeline rank) -> its file


def merge_shards(shards: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """One parameter's whole tensor from its tensor-parallel shards, in rank order: split along
    ``dim`` (0 for column-parallel layers and the vocab-parallel embedding, 1 for row-parallel
    ones), or replicated when ``dim`` is None (every rank holds it all; rank 0's is taken)."""
    return shards[0] if dim is None else torch.cat(shards, dim)


def export_checkpoint(
    load_dir: str | os.PathLike, output_dir: str | os.PathLike, iteration: int | None = None
) -> Path:
    """Writes the checkpoint of ``iteration`` (default: the latest) in ``load_dir`` as a
    directory that ``GPT2LMHeadModel.from_pretrained`` and ``GPT.from_hf_gpt2`` load; returns
    it. A missing checkpoint or file, or a model GPT-2 cannot represent, is a ConfigError."""
    root = iteration_dir(load_dir, _iteration(Path(load_dir), iteration))
    shards = _read_shards(root)
    cfg = _model_config(shards[0, 0])
    check_gpt2(cfg)
    whole = _whole_model(shards, cfg)

    def take(name: str) -> torch.Tensor:
        if name not in whole:
            raise ConfigError(f"{root}: no file holds {name}; the checkpoint is incomplete")
        return whole.pop(name)  # popped: what conversion copies (transposes) is freed at once

    return write_gpt2(cfg, gpt2_tensors(cfg, take), output_dir)


def _iteration(load_dir: Path, iteration: int | None) -> int:
    if iteration is None:
        latest = latest_iteration(load_dir)
        if latest is None:
            raise ConfigError(
                f"--load {load_dir}: no {TRACKER} there; point --load at a directory that "
                "megart train --save wrote"
            )
        return latest
    if not iteration_dir(load_dir, iteration).is_dir():
        saved = sorted(p.name for p in load_dir.glob("iter_*") if p.is_dir())
        raise ConfigError(
            f"--load {load_dir} has no checkpoint of iteration {iteration} (it holds "
            f"{', '.join(saved) or 'none'}); pass one of those, or leave --iteration out "
            "for the latest"
        )
    return iteration


def _load(path: Path) -> dict[str, Any]:
    # weights_only: an exporter is run on checkpoints from elsewhere, and the files hold only
    # tensors, numbers, strings and containers. mmap: only the model's pages are read, not
    # the optimizer's.
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise ConfigError(f"{path} cannot be read as a megart checkpoint file ({e})") from e
    if not isinstance(state, dict) or "config" not in state or "model" not in state:
        raise ConfigError(f"{path} is not a megart checkpoint file (no 'config' and 'model')")
    return state


def _read_shards(root: Path) -> Shards:
    """Every model-parallel file of checkpoint ``root``; all must be there."""
    found = sorted(root.glob(f"mp_rank_*/{FILE}"))
    if not found:
        raise ConfigError(f"{root} holds no mp_rank_*/{FILE}: it is not a megart checkpoint")
    layout = _load(found[0])["config"]
    tp = layout["tensor_model_parallel_size"]
    pp = layout["pipeline_model_parallel_size"]
    paths = {(t, p): root / rank_dir(t, p, pp) / FILE for t in range(tp) for p in range(pp)}
    missing = [str(path) for path in paths.values() if not path.is_file()]
    if missing:
        raise ConfigError(
            f"{root} was saved by tensor-parallel {tp} x pipeline-parallel {pp} ranks, but "
            f"{len(missing)} of its {len(paths)} files are missing: {', '.join(missing)}; "
            "copy the whole iteration directory the training job wrote"
        )
    return {rank: _load(path) for rank, path in paths.items()}


def _model_config(state: dict[str, Any]) -> GPTConfig:
    saved = state.get("model_config")
    if saved is None:
        # Saved before checkpoints held the model's config: the Trainer then built GPT-2's
        # architecture with GPTConfig's defaults and these sizes, and nothing else.
        layout = state["config"]
        sizes = ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads")
        return GPTConfig(**{k: layout[k] for k in sizes})
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in saved.items() if k in known})


def _layer_ids(state: dict[str, Any], pp_rank: int, pp: int, cfg: GPTConfig) -> list[list[int]]:
    if "layer_ids" in state:
        return [list(ids) for ids in state["layer_ids"]]
    # Saved before checkpoints held them: the same assignment pipeline_chunks makes.
    chunks = len(state["model"])
    return [list(r) for r in chunk_layers(cfg.num_layers, pp_rank, pp, chunks)]


@functools.cache
def _partition_dims(cfg: GPTConfig, blocks: int, first: bool, last: bool) -> dict[str, int | None]:
    """The dimension each parameter of such a chunk is split along across tensor parallelism,
    None for replicated ones: read from the ``partition_dim`` the tensor-parallel layers give
    their parameters (as the live export's gathers do), on a copy of the chunk shrunk to a
    few numbers, since only names and dims matter."""
    heads = cfg.num_attention_heads
    tiny = dataclasses.replace(
        cfg, vocab_size=1, seq_length=1, hidden_size=2 * heads, ffn_hidden_size=None
    )
    probe = GPTChunk(tiny, range(blocks), first, last)
    return {name: getattr(p, "partition_dim", None) for name, p in probe.named_parameters()}


def _whole_model(shards: Shards, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Every parameter of the one-chunk GPT (``chunk.blocks.{layer}...``), merged."""
    tp = 1 + max(t for t, _ in shards)
    pp = 1 + max(p for _, p in shards)
    whole: dict[str, torch.Tensor] = {}
    for p in range(pp):
        files = [shards[t, p] for t in range(tp)]
        for c, layers in enumerate(_layer_ids(files[0], p, pp, cfg)):
            first, last = layers[0] == 0, layers[-1] == cfg.num_layers - 1
            dims = _partition_dims(cfg, len(layers), first, last)
            states = [f["model"][c] for f in files]
            _check_names(states, dims, p, c)
            for key, dim in dims.items():
                if key == "wte.weight" and not first:
                    continue  # the last stage's copy of the tied embedding, kept equal in training
                name = key
                if key.startswith("blocks."):
                    _, j, rest = key.split(".", 2)
                    name = f"blocks.{layers[int(j)]}.{rest}"  # the chunk's j-th layer
                whole["chunk." + name] = merge_shards([s[key] for s in states], dim)
    return whole


def _check_names(
    states: list[dict[str, torch.Tensor]], dims: dict[str, int | None], pp_rank: int, chunk: int
) -> None:
    for t, state in enumerate(states):
        extra, lacking = sorted(set(state) - set(dims)), sorted(set(dims) - set(state))
        if extra or lacking:
            raise ConfigError(
                f"model chunk {chunk} of tensor rank {t}, pipeline rank {pp_rank} does not "
                f"match megart's GPT (unknown: {extra}; missing: {lacking}); was it written by "
                "another version of megart?"
            )
