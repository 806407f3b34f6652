"""megart preprocess-data: text to Megatron's indexed format, with Megatron's flag names.

    megart preprocess-data --input corpus.jsonl --output-prefix data/corpus
        [--json-keys text] [--tokenizer-type ByteTokenizer|HuggingFaceTokenizer]
        [--tokenizer-model NAME_OR_DIR] [--append-eod]

Input: JSON lines (one document per line, its text under each --json-keys key), or any other
file read whole as one document. Output, per key: ``PREFIX_KEY_document.bin/.idx``, which
``megart train --data-path PREFIX_KEY_document`` reads (and Megatron-LM too).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from megart.errors import ConfigError
from megart.training.indexed import best_dtype, write_indexed

Tokenizer = tuple[Callable[[str], list[int]], int, int | None]  # encode, vocab size, eod id


def _tokenizer(kind: str, model: str | None) -> Tokenizer:
    if kind == "ByteTokenizer":
        return (lambda text: list(text.encode("utf-8"))), 256, None
    if kind == "HuggingFaceTokenizer":
        if not model:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ConfigError(f"HuggingFaceTokenizer needs transformers ({e})") from e
        tok = AutoTokenizer.from_pretrained(model)
        return (
            lambda text: tok.encode(text, add_special_tokens=False),
            len(tok),
            tok.eos_token_id,
        )
    raise ConfigError(
        f"--tokenizer-type {kind} is not supported; use ByteTokenizer or HuggingFaceTokenizer"
    )


def _texts(paths: Sequence[str], key: str) -> Iterator[str]:
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if key not in record:
                        raise ConfigError(f"{path}:{n}: no '{key}' key; set --json-keys")
                    yield record[key]
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    json_keys: Sequence[str] = ("text",),
    tokenizer_type: str = "ByteTokenizer",
    tokenizer_model: str | None = None,
    append_eod: bool = False,
) -> dict[str, int]:
    """Tokenizes ``inputs`` and writes one indexed dataset per key; returns tokens per
    output prefix."""
    encode, vocab, eod = _tokenizer(tokenizer_type, tokenizer_model)
    if append_eod and eod is None:
        raise ConfigError(f"--append-eod: {tokenizer_type} has no end-of-document token")
    dtype = best_dtype(vocab)
    written = {}
    for key in json_keys:
        prefix = f"{output_prefix}_{key}_document"
        docs = (
            np.asarray(encode(text) + ([eod] if append_eod else []), dtype=np.int64)
            for text in _texts(inputs, key)
        )
        written[prefix] = write_indexed(prefix, docs, dtype)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megart preprocess-data", description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="JSON-lines or text files")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--tokenizer-type", default="ByteTokenizer")
    p.add_argument("--tokenizer-model", default=None, help="a Hugging Face name or directory")
    p.add_argument("--append-eod", action="store_true")
    args = p.parse_args(argv)
    try:
        written = preprocess(
            args.input,
            args.output_prefix,
            args.json_keys,
            args.tokenizer_type,
            args.tokenizer_model,
            args.append_eod,
        )
    except (ConfigError, OSError, json.JSONDecodeError) as e:
        print(f"megart preprocess-data: error: {e}", file=sys.stderr)
        return 2
    for prefix, tokens in written.items():
        print(f"{prefix}.bin / .idx: {tokens:,} tokens")
    return 0
