"""Megatron-LM's --eod-mask-loss, --reset-position-ids and --reset-attention-mask in training:
which token ends a document, what megart refuses of the three, and each microbatch's loss mask,
positions and document ids (megart.models.documents says what they mean).

The end-of-document (EOD) id is the tokenizer's, as Megatron's GPTDataset takes
``tokenizer.eod``: GPT2BPETokenizer's ``<|endoftext|>``, HuggingFaceTokenizer's
``eos_token_id``, NullTokenizer's extra id (--vocab-size). The built-in corpus (Python sources
as bytes, files joined with nothing between them) and data given without --tokenizer-type have
none, so the flags are refused there.

The loss, as Megatron-LM's loss_func and its schedules: each microbatch's loss is the sum of its
unmasked tokens' losses over their count (at least 1), then, as without the flags, the mean over
microbatches and data (and context) parallel ranks. With --calculate-per-token-loss the
gradient is instead that of the global batch's sum over its unmasked tokens' count (every rank
draws the whole global batch, so each knows that count before its backward). Either way the
reported loss is the global batch's unmasked tokens' mean, as Megatron reports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.context_parallel import split_for_cp
from megart.models.documents import (
    Documents,
    document_ids,
    document_positions,
    eod_loss_mask,
)
from megart.training.megatron_flags import hf_tokenizer

FLAGS = ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")


def given(config: Any) -> list[str]:
    """The document flags the run gives, spelt as on the command line."""
    return ["--" + f.replace("_", "-") for f in FLAGS if getattr(config, f, False)]


def eod_token(config: Any) -> int:
    """The tokenizer's end-of-document id, or a ConfigError naming the flags that need it."""
    flags = " and ".join(given(config)) or "the document flags"
    kind = config.tokenizer_type
    if kind is None and (config.vocab_file or config.merge_file):
        kind = "GPT2BPETokenizer"
    if kind is None:
        source = (
            "--mock-data"
            if config.mock_data
            else f"--data-path {config.data_path}"
            if config.data_path
            else f"--train-data-path {config.train_data_path}"
            if config.train_data_path
            else "the built-in corpus (Python sources as bytes, with no token between files)"
        )
        raise ConfigError(
            f"{flags} cut samples at the tokenizer's end-of-document token, and {source} "
            "comes with no tokenizer: give --tokenizer-type (GPT2BPETokenizer with --vocab-file "
            "and --merge-file, HuggingFaceTokenizer with --tokenizer-model, or NullTokenizer) "
            "and --data-path of documents that end with it (megart preprocess-data --append-eod), "
            f"or leave out {flags}"
        )
    if kind == "NullTokenizer":
        return config.vocab_size - 1  # Megatron's: the id after --vocab-size's (resolved +1)
    eod = _named_eod(kind, config.vocab_file, config.tokenizer_model)
    if eod is None:
        raise ConfigError(
            f"{flags}: --tokenizer-type {kind} ({config.tokenizer_model or config.vocab_file}) "
            "has no end-of-document token (GPT2BPETokenizer's <|endoftext|>, a Hugging Face "
            f"tokenizer's eos token); use a tokenizer with one, or leave out {flags}"
        )
    return eod


def _named_eod(kind: str, vocab_file: str | None, tokenizer_model: str | None) -> int | None:
    if kind == "GPT2BPETokenizer":
        try:
            with open(vocab_file, encoding="utf-8") as f:
                return json.load(f).get("<|endoftext|>")
        except (OSError, ValueError) as e:
            raise ConfigError(f"--vocab-file {vocab_file}: {e}") from e
    return hf_tokenizer(tokenizer_model).eos_token_id


def check_document_flags(config: Any) -> None:
    """Refuses, naming the flags, what megart does not do with the document flags."""
    if not given(config):
        return
    eod_token(config)
    if not config.reset_attention_mask:
        return
    if config.context_parallel_size > 1:
        raise ConfigError(
            f"--reset-attention-mask with --context-parallel-size {config.context_parallel_size}: "
            "megart's context-parallel attention masks by global positions only, not by "
            "documents; use --context-parallel-size 1, or leave out --reset-attention-mask"
        )
    if not config.create_attention_mask_in_dataloader:
        raise ConfigError(
            "--reset-attention-mask with --no-create-attention-mask-in-dataloader: Megatron-LM "
            "then builds no mask for the reset to apply to, and attends causally over the whole "
            "sample; give one of them (megart builds the documents' mask in the model)"
        )


@dataclass
class MaskedTargets:
    """One microbatch's targets under --eod-mask-loss: the labels [b, s], the loss mask [b, s]
    (this rank's context-parallel part of both) and what the mask's loss sum is divided by for
    the backward (None: the microbatch's own unmasked count, at least 1)."""

    labels: torch.Tensor
    mask: torch.Tensor
    denominator: float | None = None


class DocumentBatches:
    """Cuts a rank's rows of a global batch into microbatches with their document data."""

    def __init__(self, config: Any, dp_cp: int) -> None:
        self.config, self.dp_cp = config, dp_cp
        self.eod = eod_token(config)

    def split(
        self,
        global_inputs: torch.Tensor,
        rows: slice,
        targets: torch.Tensor,
        cp_rank: int,
        m: int,
        device: torch.device,
    ) -> tuple[list[Any], list[Documents] | None]:
        """The targets (MaskedTargets under --eod-mask-loss, else the labels) and Documents
        (None without either reset flag) of each of this rank's ``m`` microbatches: ``rows``
        of ``global_inputs`` [B, s] (whole sequences: masks and positions are found before
        the context-parallel split); ``targets`` are this rank's rows and part already."""
        c, eod = self.config, self.eod
        cp = c.context_parallel_size
        inputs = global_inputs[rows]
        b = c.micro_batch_size

        def parts(x: torch.Tensor) -> list[torch.Tensor]:
            return [t.to(device) for t in split_for_cp(x, 1, cp, cp_rank).split(b)]

        count = len(targets) // b
        positions = (
            parts(document_positions(inputs, eod)) if c.reset_position_ids else [None] * count
        )
        ids = parts(document_ids(inputs, eod)) if c.reset_attention_mask else [None] * count
        documents = None
        if c.reset_position_ids or c.reset_attention_mask:
            documents = [Documents(p, i) for p, i in zip(positions, ids, strict=True)]
        labels = [y.to(device) for y in targets.split(b)]
        if not c.eod_mask_loss:
            return labels, documents
        denominator = None
        if c.calculate_per_token_loss:
            # The gradient of (global sum / global count): each microbatch's sum times m dp cp /
            # count, since the engine divides by m and the gradients are averaged over dp x cp.
            unmasked = float(eod_loss_mask(global_inputs, eod).sum())
            denominator = max(unmasked, 1.0) / (m * self.dp_cp)
        masks = parts(eod_loss_mask(inputs, eod))
        return [MaskedTargets(y, k, denominator) for y, k in zip(labels, masks, strict=True)], (
            documents
        )


def masked_loss(
    token_losses: torch.Tensor, targets: MaskedTargets
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the loss to differentiate, the sum of the unmasked tokens' losses, their count) from
    each token's loss [s, b] (GPTChunk.token_losses)."""
    wide = token_losses.to(torch.promote_types(token_losses.dtype, torch.float32))
    mask = targets.mask.t().to(wide.dtype)
    total = (wide * mask).sum()
    count = mask.sum()
    denominator = count.clamp(min=1) if targets.denominator is None else targets.denominator
    return total / denominator, total.detach(), count
