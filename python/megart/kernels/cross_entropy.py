"""Vocab-parallel cross-entropy that needs no second buffer the size of the logits.

megart.tensor_parallel.vocab_parallel_cross_entropy keeps the softmax for the backward (and an
fp32 copy of 16-bit logits). Here the forward keeps three fp32 numbers per token and the
logits themselves, and the backward overwrites the logits with their gradient: for a GPT at
vocabulary 50304 that is the largest activation of the step, not allocated twice.

Per token, each rank computes from its slice: the maximum logit, the sum of exp(logit - max)
and the target's logit (0 when another rank holds the target). The tensor-parallel reductions
are the same three as the unfused op: the maximum, then the sums (each rank's sum rescaled to
the global maximum) and target logits in one all-reduce.

The masking of targets, the target logit, the loss formula and the one-hot term of the gradient
are megart.tensor_parallel.cross_entropy's, shared with the unfused op. How the sums are formed
is not: the unfused op reduces the maximum first and keeps exp(logit - global max) as its
softmax, while the CUDA kernel makes one pass over the logits without a global maximum, so its
sums are per slice and are rescaled here. The torch reference below follows the kernel, so that
the CPU runs this Function's logic exactly as the GPU does.
"""

from __future__ import annotations

from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.errors import ConfigError
from megart.kernels._dispatch import compute_dtype, cuda_kernel, launch
from megart.tensor_parallel._group import group_rank, group_size
from megart.tensor_parallel.cross_entropy import (
    subtract_target_,
    target_in_slice,
    target_logits,
    token_losses,
)


def cross_entropy_stats_reference(
    logits: torch.Tensor, target: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits ``[n, V]`` (vocabulary ids [start, start + V)) and targets ``[n]``: each row's
    maximum, sum of exp(logit - maximum) (0 for a row of only -inf, e.g. padding) and target
    logit (0 when the target is not in this slice)."""
    x = logits.to(compute_dtype(logits.dtype))
    top = x.max(dim=-1).values
    shift = top.masked_fill(top == float("-inf"), 0.0)
    sum_exp = (x - shift.unsqueeze(-1)).exp_().sum(dim=-1)
    local, elsewhere = target_in_slice(target, start, x.shape[-1])
    return top, sum_exp, target_logits(x, local, elsewhere)


def cross_entropy_backward_reference_(
    logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    row_max: torch.Tensor,
    sum_exp: torch.Tensor,
    grad_loss: torch.Tensor,
) -> torch.Tensor:
    """Overwrites logits ``[n, V]`` with (softmax - onehot(target)) * grad_loss, from the global
    maximum and sum of exponentials per row; returns logits."""
    x = logits.to(compute_dtype(logits.dtype))  # the logits themselves when already fp32/fp64
    x.sub_(row_max.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1)).mul_(grad_loss.unsqueeze(-1))
    subtract_target_(x, *target_in_slice(target, start, x.shape[-1]), grad_loss)
    if x is not logits:
        logits.copy_(x)
    return logits


def _stats(logits: torch.Tensor, target: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
    kernel = cuda_kernel("vocab_cross_entropy_forward", logits)
    if kernel is None:
        return cross_entropy_stats_reference(logits, target, start)
    rows, vocab = logits.shape
    top, sum_exp, target_logit = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    launch(kernel, logits, logits, target, top, sum_exp, target_logit, rows, vocab, start)
    return top, sum_exp, target_logit


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ProcessGroup | None,
        ignore_index: int,
    ) -> torch.Tensor:
        start = group_rank(group) * logits.shape[-1]
        top, sum_exp, target_logit = _stats(logits, target, start)
        if group_size(group) > 1:
            local_top = top
            top = local_top.clone()
            dist.all_reduce(top, op="max", group=group)
            # Rescale each rank's sum to the global maximum; a slice of only -inf adds 0.
            rescale = torch.exp(local_top - top).masked_fill(local_top == float("-inf"), 0.0)
            both = torch.stack([sum_exp * rescale, target_logit])
            dist.all_reduce(both, group=group)
            sum_exp, target_logit = both[0], both[1]
        ignored = target == ignore_index
        loss = token_losses(sum_exp, target_logit - top, ignored)
        ctx.start, ctx.consumed = start, False
        ctx.save_for_backward(logits, target, top, sum_exp, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        if ctx.consumed:
            raise ConfigError(
                "the fused cross-entropy's backward overwrote the logits with their gradient, "
                "so it cannot run a second time (retain_graph); use "
                "megart.tensor_parallel.vocab_parallel_cross_entropy for that"
            )
        ctx.consumed = True
        logits, target, top, sum_exp, ignored = ctx.saved_tensors
        grad_loss = grad_loss.to(top.dtype).masked_fill(ignored, 0.0).contiguous()
        kernel = cuda_kernel("vocab_cross_entropy_backward", logits)
        if kernel is None:
            cross_entropy_backward_reference_(logits, target, ctx.start, top, sum_exp, grad_loss)
            return logits, None, None, None
        rows, vocab = logits.shape
        launch(kernel, logits, logits, target, top, sum_exp, grad_loss, rows, vocab, ctx.start)
        return logits, None, None, None


def fused_vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: ProcessGroup | None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` from this rank's vocabulary slice of the logits
    ``[..., V/t]`` and the global target ids ``[...]``; the same result as
    megart.tensor_parallel.vocab_parallel_cross_entropy (float32 loss, ignored tokens 0).

    The backward writes the gradient into the logits' storage, so: the logits must not be
    needed after the loss (true of an output layer's result; a leaf tensor is copied first,
    so a caller's own tensor is never overwritten) and backward runs once. 16-bit logits stay
    16-bit (their gradient too); the arithmetic is fp32.
    """
    if logits.dim() < 1 or target.shape != logits.shape[:-1]:
        raise ConfigError(
            f"cross-entropy: target {tuple(target.shape)} must be the logits' shape "
            f"{tuple(logits.shape)} without its last (vocabulary) dimension"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ConfigError(f"cross-entropy: target ids must be integers, not {target.dtype}")
    if target.device != logits.device:
        raise ConfigError(f"cross-entropy: logits on {logits.device} but target on {target.device}")
    if not logits.dtype.is_floating_point:
        raise ConfigError(f"cross-entropy: logits must be floating point, not {logits.dtype}")
    if (logits.requires_grad and logits.is_leaf) or not logits.is_contiguous():
        logits = logits.clone(memory_format=torch.contiguous_format)
    vocab = logits.shape[-1]
    flat_target = target.reshape(-1).long().contiguous()
    loss = _FusedVocabParallelCrossEntropy.apply(
        logits.view(-1, vocab), flat_target, tp_group, ignore_index
    )
    return loss.view(target.shape)
