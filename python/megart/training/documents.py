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
from megart.training.pad_tokens import pad_loss_mask, pad_to_zero

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
    # With --context-parallel-size > 1 it is refused by check_context_parallel.
    if not config.create_attention_mask_in_dataloader:
        raise ConfigError(
            "--reset-attention-mask with --no-create-attention-mask-in-dataloader: Megatron-LM "
            "then builds no mask for the reset to apply to, and attends causally over the whole "
            "sample; give one of them (megart builds the documents' mask in the model)"
        )


@dataclass
class MaskedTargets:
    """One microbatch's targets under a loss mask (--eod-mask-loss, Megatron's pad labels): the
    labels [b, s], the loss mask [b, s] (this rank's context-parallel part of both) and what the
    mask's loss sum is divided by for the backward (None: the microbatch's own unmasked count,
    at least 1)."""

    labels: torch.Tensor
    mask: torch.Tensor
    denominator: float | None = None


class DocumentBatches:
    """Cuts a rank's rows of a global batch into microbatches with their document data and
    loss masks (the document flags', and under --data-order megatron Megatron-Core's mask of
    pad labels: ``pad``, megart.training.pad_tokens)."""

    def __init__(self, config: Any, dp_cp: int, pad: int | None = None) -> None:
        self.config, self.dp_cp, self.pad = config, dp_cp, pad
        self.eod = eod_token(config) if given(config) else None

    def loss_mask(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """The loss mask of samples as read (None: nothing masked): the EOD inputs' under
        --eod-mask-loss, times the pad labels' (Megatron-Core's GPTDataset: both found before
        it maps the pad id to 0)."""
        mask = eod_loss_mask(inputs, self.eod) if self.config.eod_mask_loss else None
        if self.pad is not None:
            pads = pad_loss_mask(labels, self.pad)
            mask = pads if mask is None else mask * pads
        return mask

    def split(
        self,
        global_batch: tuple[torch.Tensor, torch.Tensor],
        rows: slice,
        cp_rank: int,
        m: int,
        device: torch.device,
    ) -> tuple[list[Any], list[Documents] | None]:
        """The targets (MaskedTargets where a loss mask applies, else the labels) and Documents
        (None without either reset flag) of each of this rank's ``m`` microbatches: ``rows``
        of the global batch's inputs and labels [B, s] as read (whole sequences: masks and
        positions are found before the context-parallel split and the pad's mapping to 0)."""
        c, eod = self.config, self.eod
        global_inputs, global_labels = global_batch
        inputs, labels = global_inputs[rows], global_labels[rows]

        def parts(x: torch.Tensor) -> list[torch.Tensor]:  # m microbatches of the rows
            return microbatch_parts(c, x, cp_rank, device, len(inputs) // m)

        positions = parts(document_positions(inputs, eod)) if c.reset_position_ids else [None] * m
        ids = parts(document_ids(inputs, eod)) if c.reset_attention_mask else [None] * m
        documents = None
        if c.reset_position_ids or c.reset_attention_mask:
            documents = [Documents(p, i) for p, i in zip(positions, ids, strict=True)]
        mask = self.loss_mask(inputs, labels)
        if self.pad is not None:
            labels = pad_to_zero(labels, self.pad)
        targets = parts(labels)
        if mask is None:
            return targets, documents
        denominator = None
        if c.calculate_per_token_loss:
            # The gradient of (global sum / global count): each microbatch's sum times m dp cp /
            # count, since the engine divides by m and the gradients are averaged over dp x cp.
            unmasked = float(self.loss_mask(global_inputs, global_labels).sum())
            denominator = max(unmasked, 1.0) / (m * self.dp_cp)
        return [
            MaskedTargets(y, k, denominator) for y, k in zip(targets, parts(mask), strict=True)
        ], documents


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


def rank_microbatches(
    config: Any,
    batches: DocumentBatches | None,
    global_batch: tuple[torch.Tensor, torch.Tensor],
    dp: int,
    dp_rank: int,
    cp_rank: int,
    device: torch.device,
    micro: int | None = None,
) -> tuple[list[torch.Tensor], list[Any], list[Documents] | None]:
    """A rank's microbatches of a global batch (inputs and labels [B, s] as read): its
    data-parallel rows, cut into microbatches, each its context-parallel part; the inputs
    (Megatron's pad id mapped to 0 where ``batches`` has one), the targets (``batches``'
    MaskedTargets where a loss mask applies, else the labels) and the documents (None without
    the reset flags); ``micro`` samples each (None: --micro-batch-size)."""
    whole, labels = global_batch
    share = len(whole) // dp
    rows = slice(dp_rank * share, (dp_rank + 1) * share)
    inputs = whole[rows]
    if batches is not None and batches.pad is not None:
        inputs = pad_to_zero(inputs, batches.pad)
    inputs = microbatch_parts(config, inputs, cp_rank, device, micro)
    if batches is not None:
        return inputs, *batches.split(global_batch, rows, cp_rank, len(inputs), device)
    return inputs, microbatch_parts(config, labels[rows], cp_rank, device, micro), None


def microbatch_parts(
    config: Any, rows: torch.Tensor, cp_rank: int, device: torch.device, micro: int | None = None
) -> list[torch.Tensor]:
    """A rank's ``rows`` [n, s] of a global batch (or of anything laid out as its tokens) cut
    into microbatches of ``micro`` (None: --micro-batch-size), each this context-parallel
    rank's part of the sequence, on ``device``."""
    part = split_for_cp(rows, 1, config.context_parallel_size, cp_rank)
    return [x.to(device) for x in part.split(micro or config.micro_batch_size)]
