"""Offline export of a training checkpoint to a Hugging Face directory (GPT-2's or Llama's
format, by the model's architecture: see megart.models.hf), in one process.

    export_checkpoint("ckpt", "hf-out")  # megart export-hf --load ckpt --output hf-out

Reads every model-parallel file of one checkpoint (``iter_N/mp_rank_TT[_PPP]/``, see
megart.training.checkpoint) with no process group and merges them into the whole model through
megart.training.shards (tensor-parallel shards concatenated, pipeline chunks put back by their
layer ids: the path resharding on load takes too); the whole model goes through the same
conversion as ``GPT.save_hf``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megart.errors import ConfigError
from megart.models.hf import write_hf, writer
from megart.training.checkpoint import iteration_dir, model_config, required_latest_iteration
from megart.training.shards import read_shards, whole_tensors


def export_checkpoint(
    load_dir: str | os.PathLike, output_dir: str | os.PathLike, iteration: int | None = None
) -> Path:
    """Writes the checkpoint of ``iteration`` (default: the latest) in ``load_dir`` as a
    directory that transformers' ``from_pretrained`` (GPT2LMHeadModel or LlamaForCausalLM) and
    ``GPT.from_hf`` load; returns it. A missing checkpoint or file, or a model neither format
    can represent, is a ConfigError."""
    root = iteration_dir(load_dir, _iteration(Path(load_dir), iteration))
    shards = read_shards(root)
    cfg = model_config(shards[0, 0])
    fmt = writer(cfg)
    whole = whole_tensors(shards, cfg)

    def take(name: str) -> torch.Tensor:
        if name not in whole:
            raise ConfigError(f"{root}: no file holds {name}; the checkpoint is incomplete")
        return whole.pop(name)  # popped: what conversion copies (transposes) is freed at once

    return write_hf(fmt, cfg, fmt.hf_tensors(cfg, take), output_dir)


def _iteration(load_dir: Path, iteration: int | None) -> int:
    if iteration is None:
        return required_latest_iteration(load_dir)
    if not iteration_dir(load_dir, iteration).is_dir():
        saved = sorted(p.name for p in load_dir.glob("iter_*") if p.is_dir())
        raise ConfigError(
            f"--load {load_dir} has no checkpoint of iteration {iteration} (it holds "
            f"{', '.join(saved) or 'none'}); pass one of those, or leave --iteration out "
            "for the latest"
        )
    return iteration
