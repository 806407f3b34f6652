"""The tokenizer a checkpoint's model was trained with, recorded in the checkpoint (as
Megatron-LM's saved args record --tokenizer-type, --tokenizer-model, --vocab-file and
--merge-file), so that export-hf saves it beside the weights without being told which.

Paths are recorded absolute: a checkpoint is read from other directories than the one it was
trained in. A tokenizer from the Hugging Face hub is recorded by name. NullTokenizer (ids
only, no text) has nothing to save.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from megart.errors import ConfigError

FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def record(flags: Any) -> dict[str, str] | None:
    """The tokenizer flags of a run (a TrainConfig, or Megatron's args as a dict), for a
    checkpoint to hold; None when the run gave no tokenizer."""
    get = flags.get if isinstance(flags, Mapping) else lambda name: getattr(flags, name, None)
    values = {name: get(name) for name in FIELDS}
    if values["tokenizer_type"] is None and (values["vocab_file"] or values["merge_file"]):
        values["tokenizer_type"] = "GPT2BPETokenizer"  # as megart train takes the two files
    if values["tokenizer_type"] is None:
        return None
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        path = values[name]
        if path and (name != "tokenizer_model" or os.path.exists(path)):
            values[name] = os.path.abspath(path)  # a hub name stays a name
    return {name: value for name, value in values.items() if value is not None}


def describe(recorded: Mapping[str, str]) -> str:
    """The recorded tokenizer in a few words, for messages."""
    kind = recorded["tokenizer_type"]
    if kind == "HuggingFaceTokenizer":
        return f"{kind} {recorded.get('tokenizer_model')}"
    if kind == "GPT2BPETokenizer":
        return f"{kind} {recorded.get('vocab_file')}, {recorded.get('merge_file')}"
    return kind


def load(recorded: Mapping[str, str], vocab_size: int) -> Any:
    """The recorded tokenizer as a transformers tokenizer that save_pretrained writes, or None
    for one without text (NullTokenizer). One that cannot be loaded here (its files moved, a
    hub name not in the cache) is a ConfigError saying how to export without it."""
    from megart.models.hf_files import load_tokenizer

    kind = recorded["tokenizer_type"]
    try:
        if kind == "HuggingFaceTokenizer":
            return load_tokenizer(recorded["tokenizer_model"], vocab_size)
        if kind == "GPT2BPETokenizer":
            return _gpt2_bpe(recorded["vocab_file"], recorded["merge_file"], vocab_size)
    except (ConfigError, OSError, KeyError) as e:
        raise ConfigError(
            f"the checkpoint records the tokenizer it was trained with ({describe(recorded)}), "
            f"which cannot be loaded here ({e}): give --tokenizer-model NAME_OR_DIR, or "
            "--no-tokenizer to export the weights alone"
        ) from e
    return None


def _gpt2_bpe(vocab_file: str, merge_file: str, vocab_size: int) -> Any:
    """Megatron's GPT2BPETokenizer as a transformers tokenizer: GPT-2's byte-level BPE from a
    vocab.json and merges.txt (GPT-2's pre-tokenizing, no prefix space), <|endoftext|> its
    end-of-document token where the vocabulary has one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    for path in (vocab_file, merge_file):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no file {path}")
    bpe = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    eod = "<|endoftext|>"
    special = (
        {} if bpe.token_to_id(eod) is None else dict(bos_token=eod, eos_token=eod, unk_token=eod)
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **special)
    if len(tokenizer) > vocab_size:
        raise ConfigError(f"it has {len(tokenizer)} tokens and the model's vocabulary {vocab_size}")
    return tokenizer
