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
from megart.models.hf_deepseek_v3_mtp import bias_layer
from megart.models.hf_files import (
    DEFAULT_SHARD,
    check_dtype,
    load_tokenizer,
    parse_size,
    special_token_ids,
    write_hf,
)
from megart.training import megatron_dist, tokenizer_record
from megart.training.checkpoint import chosen_iteration, iteration_dir, model_config
from megart.training.shards import read_shards, whole_tensors

# What transformers' save_pretrained writes for a tokenizer (fast tokenizers, and the files
# of slow ones and of the special tokens, as versions 4 and 5 write them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def export_checkpoint(
    load_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    iteration: int | None = None,
    dtype: str = "float32",
    max_shard_size: str = DEFAULT_SHARD,
    tokenizer_model: str | None = None,
    recorded_tokenizer: bool = True,
    megatron: bool = False,
) -> Path:
    """Writes the checkpoint of ``iteration`` (default: the latest) in ``load_dir`` as a
    directory that transformers' ``from_pretrained`` (GPT2LMHeadModel or LlamaForCausalLM) and
    ``GPT.from_hf`` load, its weights in ``dtype`` (float32, bfloat16 or float16) in files of
    at most ``max_shard_size`` (megart.models.hf_files); returns it. Each whole tensor is
    merged from the memory-mapped files when it is written, so the export holds about one
    weight file's worth. ``tokenizer_model`` (a Hugging Face tokenizer directory or cached
    name) is saved beside the weights, with its bos/eos ids in config.json, so that the
    directory generates text as it is; without it, the tokenizer the checkpoint records
    (megart.training.tokenizer_record) is, unless ``recorded_tokenizer`` is False. A missing
    checkpoint or file, a recorded tokenizer that cannot be loaded, or a model no format
    can represent, is a ConfigError. A torch_dist store (``--ckpt-format torch_dist``) is
    read whole (megatron_checkpoint.megatron_weights) and held while it is written, and so is
    any Megatron-LM checkpoint with ``megatron`` (convert-checkpoint --from megatron: legacy
    files are then read as Megatron's converter reads them, the model's weights, where megart's
    reader of files to resume takes --fp16/--bf16 runs' fp32 main weights)."""
    check_dtype(dtype)
    limit = parse_size(max_shard_size)
    iteration = chosen_iteration(load_dir, iteration, "--iteration")
    root = iteration_dir(load_dir, iteration)
    if megatron or megatron_dist.is_dist_checkpoint(root):
        # A store of whole tensors (megart train --ckpt-format torch_dist, or Megatron-LM's), or
        # Megatron-LM's legacy files merged in memory.
        from megart.training.megatron_checkpoint import megatron_weights

        cfg, weights, recorded = megatron_weights(load_dir, iteration)
        bias_rows = None

        def merged(name: str) -> dict[str, torch.Tensor]:
            local = name.removeprefix("chunk.")
            return {name: weights[local]} if local in weights else {}

    else:
        shards = read_shards(root)
        cfg, recorded = model_config(shards[0, 0]), shards[0, 0].get("tokenizer")
        # Every layer's expert bias, kept beside the weights (DeepSeek-V3 writes it).
        bias_rows = shards[0, 0].get("expert_bias")

        def merged(name: str) -> dict[str, torch.Tensor]:
            return whole_tensors(shards, cfg, wanted=(name,))

    fmt = writer(cfg)
    config = fmt.hf_config(cfg)
    # Before the weights: a wrong tokenizer is refused at once.
    tokenizer = None
    if tokenizer_model is not None:
        tokenizer = load_tokenizer(tokenizer_model, cfg.vocab_size)
    elif recorded_tokenizer and recorded:
        tokenizer = tokenizer_record.load(recorded, cfg.vocab_size)
    if tokenizer is not None:
        config.update(special_token_ids(tokenizer))

    def take(name: str) -> torch.Tensor:
        if name.endswith(".mlp.router.expert_bias") and bias_rows is not None:
            return bias_rows[bias_layer(cfg, name)]  # a decoder's or depth's layer's row
        whole = merged(name)
        if name not in whole:
            raise ConfigError(f"{root}: no file holds {name}; the checkpoint is incomplete")
        return whole[name]

    out = write_hf(Path(output_dir), config, fmt.hf_tensors(cfg, take), dtype, limit)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    else:  # an earlier export's tokenizer is not this model's
        for name in TOKENIZER_FILES:
            (out / name).unlink(missing_ok=True)
    return out


def describe(out: Path, tokenizer_model: str | None = None) -> str:
    """What an export wrote, for the command line: the files, the format and the tokenizer
    saved (``tokenizer_model`` as given, or the one the checkpoint records)."""
    from megart.models.hf import format_name
    from megart.models.hf_files import INDEX

    shards = len(list(out.glob("model-*-of-*.safetensors")))
    files = f"{INDEX} and {shards} weight files" if shards else "model.safetensors"
    line = f"{out}: config.json and {files} ({format_name(out)})"
    if tokenizer_model is not None:
        return f"{line}; the tokenizer of {tokenizer_model}"
    if (out / "tokenizer_config.json").is_file():
        return f"{line}; the tokenizer it was trained with"
    return line
