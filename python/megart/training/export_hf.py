"""Offline export of a training checkpoint to a Hugging Face GPT-2 directory, in one process.

    export_checkpoint("ckpt", "gpt2-out")  # megart export-hf --load ckpt --output gpt2-out

Reads every model-parallel file of one checkpoint (``iter_N/mp_rank_TT[_PPP]/``, see
megart.training.checkpoint) with no process group and merges them into the whole model through
megart.training.shards (tensor-parallel shards concatenated, pipeline chunks put back by their
layer ids: the path resharding on load takes too); the whole model goes through the same
GPT-2 conversion as ``GPT.save_hf_gpt2``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megart.errors import ConfigError
from megart.models.hf import check_gpt2, gpt2_tensors, write_gpt2
from megart.training.checkpoint import iteration_dir, model_config, required_latest_iteration
from megart.training.shards import read_shards, whole_tensors


def export_checkpoint(
    load_dir: str | os.PathLike, output_dir: str | os.PathLike, iteration: int | None = None
) -> Path:
    """Writes the checkpoint of ``iteration`` (default: the latest) in ``load_dir`` as a
    directory that ``GPT2LMHeadModel.from_pretrained`` and ``GPT.from_hf_gpt2`` load; returns
    it. A missing checkpoint or file, or a model GPT-2 cannot represent, is a ConfigError."""
    root = iteration_dir(load_dir, _iteration(Path(load_dir), iteration))
    shards = read_shards(root)
    cfg = model_config(shards[0, 0])
    check_gpt2(cfg)
    whole = whole_tensors(shards, cfg)

    def take(name: str) -> torch.Tensor:
        if name not in whole:
            raise ConfigError(f"{root}: no file holds {name}; the checkpoint is incomplete")
        return whole.pop(name)  # popped: what conversion copies (transposes) is freed at once

    return write_gpt2(cfg, gpt2_tensors(cfg, take), output_dir)


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
