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
from megart.models.hf import writer
from megart.models.hf_files import (
    DEFAULT_SHARD,
    check_dtype,
    load_tokenizer,
    parse_size,
    special_token_ids,
    write_hf,
)
from megart.training.checkpoint import iteration_dir, model_config, required_latest_iteration
from megart.training.shards import read_shards, whole_tensors


def export_checkpoint(
    load_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    iteration: int | None = None,
    dtype: str = "float32",
    max_shard_size: str = DEFAULT_SHARD,
    tokenizer_model: str | None = None,
) -> Path:
    """Writes the checkpoint of ``iteration`` (default: the latest) in ``load_dir`` as a
    directory that transformers' ``from_pretrained`` (GPT2LMHeadModel or LlamaForCausalLM) and
    ``GPT.from_hf`` load, its weights in ``dtype`` (float32, bfloat16 or float16) in files of
    at most ``max_shard_size`` (megart.models.hf_files); returns it. Each whole tensor is
    merged from the memory-mapped files when it is written, so the export holds about one
    weight file's worth. ``tokenizer_model`` (a Hugging Face tokenizer directory or cached
    name) is saved beside the weights, with its bos/eos ids in config.json, so that the
    directory generates text as it is. A missing checkpoint or file, or a model neither format
    can represent, is a ConfigError."""
    check_dtype(dtype)
    limit = parse_size(max_shard_size)
    root = iteration_dir(load_dir, _iteration(Path(load_dir), iteration))
    shards = read_shards(root)
    cfg = model_config(shards[0, 0])
    fmt = writer(cfg)
    config = fmt.hf_config(cfg)
    tokenizer = None
    if tokenizer_model is not None:  # before the weights: a wrong one is refused at once
        tokenizer = load_tokenizer(tokenizer_model, cfg.vocab_size)
        config.update(special_token_ids(tokenizer))

    def take(name: str) -> torch.Tensor:
        whole = whole_tensors(shards, cfg, wanted=(name,))
        if name not in whole:
            raise ConfigError(f"{root}: no file holds {name}; the checkpoint is incomplete")
        return whole[name]

    out = write_hf(Path(output_dir), config, fmt.hf_tensors(cfg, take), dtype, limit)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


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
