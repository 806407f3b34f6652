"""Writing a Hugging Face directory: the weights in safetensors files of bounded size, as
``save_pretrained`` shards them, and config.json.

The tensors arrive one at a time (megart.models.hf_gpt2/hf_llama's ``hf_tensors``), so that a
writer holds at most one file's worth: exporting a model larger than the memory works. One
file is ``model.safetensors``; more are ``model-0000i-of-0000N.safetensors`` with the
``model.safetensors.index.json`` that maps each tensor to its file, the layout transformers'
``from_pretrained`` reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_SHARD = "5GB"  # save_pretrained's default in transformers 4
_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
INDEX = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """Bytes of a size as transformers spells it: "5GB" (10^9), "500MiB" (2^20), "4096"."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B)?\s*", text, flags=re.IGNORECASE)
    if not match or int(match[1]) < 1:
        raise ConfigError(
            f"--max-shard-size {text!r}: give a positive size such as 5GB, 500MB or 2GiB"
        )
    return int(match[1]) * _UNITS[(match[2] or "").upper()]


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")


def write_hf(
    root: Path,
    config: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: str = "float32",
    max_shard_bytes: int = parse_size(DEFAULT_SHARD),
) -> Path:
    """Writes ``tensors`` in ``dtype`` into files of at most ``max_shard_bytes`` (a larger
    tensor alone in its file) and ``config`` as config.json, into directory ``root``. Earlier
    weight files of this layout there are removed once the new ones are all written (so none
    is read with them), and not before: an export that fails leaves what was there."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    files: list[list[str]] = []  # the names each file holds

    def part(i: int) -> Path:  # numbered now, renamed once the count is known
        return root / f".megart-part-{i}.safetensors.tmp"

    pending: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            save_file(pending, str(part(len(files))), metadata={"format": "pt"})
            files.append(list(pending))
            pending, size = {}, 0

    try:
        for name, tensor in tensors:
            tensor = tensor.detach().to(DTYPES[dtype]).contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            if size + nbytes > max_shard_bytes:
                flush()
            pending[name], size, total = tensor, size + nbytes, total + nbytes
        flush()
    except BaseException:
        for i in range(len(files)):
            part(i).unlink(missing_ok=True)
        raise
    for old in [*root.glob("model*.safetensors"), root / INDEX]:
        old.unlink(missing_ok=True)
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    for i, name in enumerate(names):
        part(i).rename(root / name)
    if len(files) > 1:
        weight_map = {t: names[i] for i, held in enumerate(files) for t in held}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / INDEX).write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    return root


def load_tokenizer(name_or_dir: str, vocab_size: int) -> Any:
    """The Hugging Face tokenizer ``name_or_dir`` (a directory, or a name in the local cache),
    to be saved beside exported weights; refused when it has more tokens than the model."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer-model {name_or_dir}: {e}") from e
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            f"--tokenizer-model {name_or_dir} has {len(tokenizer)} tokens and the model's "
            f"vocabulary {vocab_size}: give the tokenizer the model was trained with"
        )
    return tokenizer


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """config.json's bos_token_id and eos_token_id (what generation stops at) from the
    tokenizer, where it has them."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    return {key: value for key, value in ids.items() if value is not None}
