"""Cross-entropy over logits whose vocabulary is split across a tensor-parallel group.

Rank r holds the logits of vocabulary ids [r V/t, (r+1) V/t): the output of a
ColumnParallelLinear (or of a tied VocabParallelEmbedding's weight) without gathering. The
loss needs only three numbers per token from the whole vocabulary, each reduced across the
group: the maximum logit (for a stable exponent), the sum of exponentials, and the target's
logit (held by exactly one rank, zero elsewhere). So each rank works on V/t logits per token,
communicates 3 values per token, and no rank ever builds full-vocabulary logits.

The gradient with respect to the logits is softmax - one_hot(target), which each rank can form
on its own slice from the softmax it kept in the forward pass.
"""

from __future__ import annotations

from typing import Any

import torch

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.tensor_parallel._group import group_rank, group_size

# The pieces below are shared with megart.kernels' fused op (its torch reference and autograd
# Function), so the unfused and fused losses agree by construction on everything but how the
# per-token sums are reduced (see kernels/cross_entropy.py for why those differ).


def target_in_slice(
    target: torch.Tensor, start: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each global target id falls in this rank's vocabulary slice [start, start + vocab):
    (its index in the slice, 0 where another rank holds it; the mask of those held
    elsewhere). An id in no slice (an ignore_index such as -100) is held elsewhere on every
    rank."""
    elsewhere = (target < start) | (target >= start + vocab)
    return (target - start).masked_fill(elsewhere, 0), elsewhere


def target_logits(
    logits: torch.Tensor, local: torch.Tensor, elsewhere: torch.Tensor
) -> torch.Tensor:
    """Each token's target logit from this slice ``[..., vocab]``, 0 where another rank holds
    it: summed over the group, every token gets exactly one."""
    return logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)


def token_losses(
    sum_exp: torch.Tensor, target_logit: torch.Tensor, ignored: torch.Tensor
) -> torch.Tensor:
    """log(sum of exp(logit - max)) - (target logit - max): the per-token loss from the
    group-wide sums, with ``target_logit`` already shifted by the maximum; 0 where ignored."""
    return (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)


def subtract_target_(
    grad: torch.Tensor, local: torch.Tensor, elsewhere: torch.Tensor, grad_loss: torch.Tensor
) -> torch.Tensor:
    """Turns ``grad`` = softmax * grad_loss (this slice) into the logits' gradient, (softmax -
    one_hot(target)) * grad_loss, in place: only the rank holding a target subtracts. Returns
    ``grad``. ``grad_loss`` must already be 0 for ignored tokens."""
    hit = grad_loss.masked_fill(elsewhere, 0.0)
    return grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1).to(grad.dtype))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ProcessGroup | None,
        ignore_index: int,
    ) -> torch.Tensor:
        parallel = group_size(group) > 1
        vocab_here = logits.shape[-1]
        start = group_rank(group) * vocab_here

        # Shifting by the global maximum keeps every exponent <= 0 on every rank.
        top = logits.max(dim=-1).values.contiguous()
        if parallel:
            dist.all_reduce(top, op="max", group=group)
        shifted = logits - top.unsqueeze(-1)

        local_target, elsewhere = target_in_slice(target, start, vocab_here)
        target_logit = target_logits(shifted, local_target, elsewhere)

        exp = shifted.exp_()  # `shifted` is ours and no longer needed: reuse its memory
        sum_exp = exp.sum(dim=-1)
        if parallel:
            # One all-reduce for both per-token sums.
            both = torch.stack([sum_exp, target_logit])
            dist.all_reduce(both, group=group)
            sum_exp, target_logit = both[0], both[1]

        ignored = target == ignore_index
        loss = token_losses(sum_exp, target_logit, ignored)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, elsewhere, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        softmax, local_target, elsewhere, ignored = ctx.saved_tensors
        grad_loss = grad_loss.masked_fill(ignored, 0.0)
        # d loss / d logits = softmax - one_hot(target), scaled by the incoming gradient. A new
        # tensor rather than an in-place update of `softmax`, so backward may run twice
        # (retain_graph=True).
        grad = softmax * grad_loss.unsqueeze(-1)
        return subtract_target_(grad, local_target, elsewhere, grad_loss), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: ProcessGroup | None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy, ``[...]``, from this rank's vocabulary slice of the logits,
    ``[..., V/t]``, and the global target ids ``[...]`` (the same on every rank).

    Tokens whose target is ``ignore_index`` get loss 0 and no gradient, as with
    ``F.cross_entropy(..., reduction="none", ignore_index=...)``. Half-precision logits are
    computed in float32 and the loss is float32. The result is the same on every rank.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return _VocabParallelCrossEntropy.apply(logits, target.long(), tp_group, ignore_index)
