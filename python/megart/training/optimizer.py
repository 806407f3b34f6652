"""The Trainer's optimizer and the gradient work between backward and its step.

Two ways to step, chosen by --use-distributed-optimizer: every data-parallel rank steps every
parameter after an all-reduce of the gradients (the default), or each steps its own 1/dp slice
after a reduce-scatter (megart.training.distributed_optimizer). The functions here hide which:
the tied embedding's gradient sum, the overflow check and the clipping each touch only the
gradients the step will read.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

import megart.distributed as dist
import megart.optim
from megart.tensor_parallel import grad_of
from megart.training.distributed_optimizer import DistributedOptimizer
from megart.training.expert_grads import split_buckets
from megart.training.grad_norm import clip_grad_norm, clip_grads, counted_in_norm
from megart.training.grad_sync import GradientBuckets, megatron_bucket_size
from megart.training.lr import weight_decay_rate
from megart.training.main_weights import MainWeights

Optimizer = torch.optim.Optimizer | DistributedOptimizer | MainWeights


def _tied_embeddings(chunks: list[torch.nn.Module], pp: int) -> list[torch.nn.Parameter]:
    """The word embeddings the first and last pipeline stages share (none with one stage in
    one chunk, or when the output layer has its own weight, unless multi-token prediction's
    depths look tokens up on the last); both are on one rank in zb-v."""
    cfg = chunks[0].cfg
    if (pp == 1 and len(chunks) == 1) or (
        cfg.untie_embeddings_and_output_weights and not cfg.mtp_num_layers
    ):
        return []
    return [c.wte.weight for c in chunks if hasattr(c, "wte") and (c.first or c.last)]


# Megatron-Core's embedding and output-layer parameters (is_embedding_or_output_parameter:
# the word embedding where it is used as one, the output layer on the last stage, the tied
# copy included): --decoupled-lr's group.
DECOUPLED = ("wte.weight", "output_layer.weight")


def group_index(name: str, tensor: torch.Tensor, decoupled: bool) -> int:
    """Which of param_groups' groups the parameter ``name`` belongs to: 0 the decayed matrices,
    1 --decoupled-lr's (when ``decoupled``), the last the biases and norms (no decay)."""
    if decoupled and name in DECOUPLED:
        return 1
    if tensor.dim() >= 2:
        return 0
    return 2 if decoupled else 1


def param_groups(config: Any, chunks: list[torch.nn.Module]) -> list[dict[str, Any]]:
    """AdamW's groups: weight decay on matrices, none on biases and norms; with --decoupled-lr
    the embedding and output layer in a group of their own between them (Megatron-Core's order)
    with its peak and floor (``max_lr``, ``min_lr``), present on every rank (maybe empty), as
    Megatron-Core aligns its groups across ranks."""
    c = config
    rates = c.decoupled_rates()
    members: list[list[torch.nn.Parameter]] = [[] for _ in range(2 if rates is None else 3)]
    for chunk in chunks:
        for n, p in chunk.named_parameters():
            members[group_index(n, p, rates is not None)].append(p)
    decay = weight_decay_rate(c, 0)
    groups = [{"params": members[0], "weight_decay": decay}]
    if rates is not None:
        peak, floor = rates
        groups.append({"params": members[1], "weight_decay": decay,
                       "max_lr": peak, "min_lr": floor})  # fmt: skip
    groups.append({"params": members[-1], "weight_decay": 0.0})
    return groups


def set_weight_decay(optimizer: Optimizer, decay: float) -> None:
    """``decay`` on param_groups' decayed groups (all but the last: biases and norms)."""
    for group in optimizer.param_groups[:-1]:
        group["weight_decay"] = decay


def build(
    config: Any, chunks: list[torch.nn.Module], grid: Any, device: torch.device
) -> tuple[GradientBuckets, Optimizer]:
    """The gradient buckets and the AdamW of this rank's ``chunks``: weight decay on matrices,
    none on biases and norms."""
    c = config
    params = [p for chunk in chunks for p in chunk.parameters()]
    shard = c.use_distributed_optimizer
    elements = None
    if c.ddp_bucket_size is not None or c.ddp_num_buckets is not None:
        # Megatron's size, counted over this rank's chunks; megart applies it on every stage
        # and chunk, where Megatron buckets only the first stage's first chunk.
        elements = megatron_bucket_size(
            sum(p.numel() for p in params),
            grid.layout.dp * grid.layout.cp,
            c.ddp_bucket_size,
            c.ddp_num_buckets,
        )
    # Context-parallel ranks hold the same weights and gradients of their own tokens: the
    # gradients are averaged (and the distributed optimizer sharded) over dp x cp, as Megatron's
    # data-parallel group with context parallelism.
    make = functools.partial(
        GradientBuckets,
        overlap=c.overlap_grad_reduce,
        shard=shard,
        alone=_tied_embeddings(chunks, c.pp),
        reduce_dtype=torch.bfloat16 if c.grad_reduce_in_bf16 else None,
        bucket_elements=elements,
        main_grads=c.half_weights,
    )
    # Expert parallelism: the experts' gradients in buckets of their own (training.expert_grads).
    buckets = split_buckets(params, grid, make) if grid.ep > 1 else make(params, grid.dp_cp_group)
    groups = param_groups(c, chunks)
    # megart's multi-tensor AdamW on CPU (tested against torch's); on GPU torch's fused AdamW
    # until megart's CUDA kernel has been verified on one.
    adamw = (
        megart.optim.AdamW
        if device.type == "cpu"
        else functools.partial(torch.optim.AdamW, fused=True)
    )
    make = functools.partial(adamw, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
    if shard:
        zero = DistributedOptimizer(groups, buckets, make)
        if c.overlap_param_gather:
            zero.overlap_with_forward(chunks)
        return buckets, zero
    if c.half_weights:
        return buckets, MainWeights(groups, make)
    return buckets, make(groups)


def full_precision(optimizer: Optimizer) -> contextlib.AbstractContextManager:
    """A context in which the parameters hold their fp32 weights, for checkpoints: with 16-bit
    weights (--half-weights) the optimizer's main weights (a collective with the distributed
    optimizer), else the parameters as they are."""
    if isinstance(optimizer, DistributedOptimizer | MainWeights):
        return optimizer.full_precision()
    return contextlib.nullcontext()


def share_embedding_grads(
    chunks: list[torch.nn.Module], grid: Any, pp: int, buckets: GradientBuckets
) -> None:
    """First and last stage each hold the tied embedding; their gradients are summed (with a
    sharded optimizer only the slice this rank steps, which is the same slice on both stages:
    the embedding has a bucket of its own)."""
    grads = []
    for weight in _tied_embeddings(chunks, pp):
        grad = grad_of(weight)
        if buckets.shard:
            b = buckets.bucket_of(weight)
            start, end = buckets.shard_range(b)
            grad = b.buffer[start:end]
        grads.append(grad)
    if len(grads) == 2:  # zb-v's V: the first and the last stage share this rank
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
        return
    if grid.embedding_group is None:
        return
    for grad in grads:
        dist.all_reduce(grad, group=grid.embedding_group)


def stepped_params(chunks: list[torch.nn.Module], optimizer: Optimizer) -> list[torch.Tensor]:
    """The tensors the step updates, each with the ``.grad`` it reads: what fp16 unscales."""
    if isinstance(optimizer, DistributedOptimizer):
        return [piece.data for piece in optimizer.pieces]
    if isinstance(optimizer, MainWeights):
        return optimizer.mains
    return [p for chunk in chunks for p in chunk.parameters()]


def clip(
    chunks: list[torch.nn.Module],
    grid: Any,
    optimizer: Optimizer,
    max_norm: float,
    device: torch.device,
) -> float:
    """The global gradient norm, with the gradients the step reads scaled to ``max_norm``."""
    if not isinstance(optimizer, DistributedOptimizer):
        return clip_grad_norm(
            chunks, grid.tp_rank, grid.mp_group, max_norm, device, getattr(grid, "ep_group", None)
        )
    # Each rank holds 1/dp of the averaged gradients: count its slices of what the
    # model-parallel rule counts, and sum over every rank (data x model parallel).
    counted = [piece.grad for piece in counted_pieces(chunks, optimizer, grid.tp_rank)]
    return clip_grads(counted, optimizer.shard_grads(), None, max_norm, device)


def counted_pieces(
    chunks: list[torch.nn.Module], optimizer: DistributedOptimizer, tp_rank: int
) -> list[torch.Tensor]:
    """This rank's slices of the distributed optimizer's parameters (each with its slice of
    the gradient as ``.grad``) that the model-parallel rule counts once (counted_in_norm):
    together over every rank, each element of the model once."""
    where = {id(p): (chunk, name) for chunk in chunks for name, p in chunk.named_parameters()}
    return [
        piece.data
        for piece in optimizer.pieces
        if counted_in_norm(*where[id(piece.param)], piece.param, tp_rank)
    ]


def overflowed(
    chunks: list[torch.nn.Module], optimizer: Optimizer, scaler: Any, config: Any, device: Any
) -> bool:
    """fp16: unscales the gradients the step reads and says whether any rank saw an inf or NaN
    (then every rank skips the step); updates a dynamic loss scale (no --loss-scale)."""
    found = scaler.unscale_(stepped_params(chunks, optimizer)).to(device)
    dist.all_reduce(found, op="max")
    overflow = bool(found.item())
    if config.loss_scale is None:
        scaler.update(overflow)
    return overflow
