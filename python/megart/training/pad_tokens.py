"""Megatron-Core's pad tokens under ``--data-order megatron``.

Megatron-Core's GPTDataset (0.16.1) takes the tokenizer's pad id, and wherever a sample holds
it: the loss of a label that is the pad id is masked, and the pad id is replaced by 0 in both
the input tokens and the labels (so that the embedding can look it up). The masks of
--eod-mask-loss, --reset-position-ids and --reset-attention-mask are found before that
replacement, on the tokens as read. A pad id that equals the tokenizer's end-of-document or
end-of-sentence id is ambiguous: Megatron then masks and replaces nothing (its pad becomes -1,
an id no data holds) unless --allow-ambiguous-pad-tokens asks it to treat that id as the pad.

Which tokenizers have a pad id, as Megatron-LM builds them (megatron.core.tokenizers, its
default tokenizer system): a Hugging Face tokenizer's pad_token_id (HuggingFaceTokenizer), none
for GPT2BPETokenizer (GPT-2's tokenizer has no pad token) and none for NullTokenizer. megart's
own order (--data-order megart) keeps every token as read."""

from __future__ import annotations

from typing import Any

import torch

from megart.errors import ConfigError
from megart.training.megatron_flags import hf_tokenizer


def megatron_pad_id(config: Any) -> int | None:
    """The id whose labels Megatron-Core's GPTDataset masks (and maps to 0) for this run, or
    None where it masks nothing: not --data-order megatron, a tokenizer without a pad id, or
    a pad id that is also the end-of-document one without --allow-ambiguous-pad-tokens."""
    if config.data_order != "megatron" or config.tokenizer_type != "HuggingFaceTokenizer":
        return None
    tokenizer = hf_tokenizer(config.tokenizer_model)
    pad = tokenizer.pad_token_id
    if pad is None:
        return None
    # Megatron's collision check: its text tokenizer has no special_tokens_dict, so the pad id
    # is checked against eos and eod, both the Hugging Face eos token's id there.
    if pad == tokenizer.eos_token_id and not config.allow_ambiguous_pad_tokens:
        return None
    return int(pad)


def check_pad_flags(config: Any) -> None:
    """--allow-ambiguous-pad-tokens changes Megatron's samples only: refused elsewhere."""
    if config.allow_ambiguous_pad_tokens and config.data_order != "megatron":
        raise ConfigError(
            "--allow-ambiguous-pad-tokens with --data-order megart: megart's own order masks "
            "no pad token (Megatron-Core's GPTDataset does, and the flag decides which); give "
            "--data-order megatron or leave the flag out"
        )


def pad_loss_mask(labels: torch.Tensor, pad: int) -> torch.Tensor:
    """1.0 where the label is not the pad id, 0.0 where it is (float, as Megatron's)."""
    return (labels != pad).float()


def pad_to_zero(tokens: torch.Tensor, pad: int) -> torch.Tensor:
    """The tokens with the pad id replaced by 0 (a new tensor: the batch's rows are views)."""
    return torch.where(tokens == pad, torch.zeros_like(tokens), tokens)
