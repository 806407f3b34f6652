"""Linear layers and the embedding, split across a tensor-parallel group.

Weights follow torch's layout ([out, in] for linear, [vocab, dim] for embedding):

- ``ColumnParallelLinear`` splits the output features: rank r holds rows r*out/t..(r+1)*out/t
  of the weight and of the bias, and produces that slice of the output.
- ``RowParallelLinear`` splits the input features: rank r holds that column block of the
  weight, multiplies its slice of the input, and the partial products are summed across the
  group. Its bias is replicated and added once, after the sum.
- ``VocabParallelEmbedding`` splits the vocabulary: rank r looks up the ids it owns, writes
  zeros for the others, and the rows are summed across the group.

Initialisation does not depend on the layout: every rank draws the full ("master") weight from
the same generator and keeps its own shard, so a seed gives the same model for every t. It
costs one full weight of host memory per layer while building, which is the price of that
guarantee. ``generator=None`` draws from torch's default CPU generator, which must then be
seeded the same on every rank (it is, after ``seed_tensor_parallel``).

Parameters carry two attributes for the code that reduces or saves them: ``partition_dim``
(the dimension split across the group; absent on replicated parameters) and
``sequence_parallel`` (True on replicated parameters whose gradient is only a partial sum
under sequence parallelism: :func:`sync_sequence_parallel_grads` completes them).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.errors import ConfigError
from megart.tensor_parallel._group import divide, group_rank, group_size
from megart.tensor_parallel.column_entry import WeightGradSlot, enter_column_region
from megart.tensor_parallel.mappings import (
    gather_from_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
)
from megart.tensor_parallel.weight_grad import grad_of, linear

InitMethod = Callable[[torch.Tensor, torch.Generator | None], object]
"""Fills a full (master) weight in place, drawing from the given generator."""


def normal_init(std: float = 0.02) -> InitMethod:
    """N(0, std^2), GPT-2's and Megatron's default."""

    def init(weight: torch.Tensor, generator: torch.Generator | None) -> None:
        nn.init.normal_(weight, mean=0.0, std=std, generator=generator)

    return init


def xavier_uniform_init(fan_out: int | None = None, fan_in: int | None = None) -> InitMethod:
    """U(-a, a) with a = sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio's, torch's
    xavier_uniform_); the fans of the weight it fills ([out, in]) unless given, for a weight
    that stands for part of a larger one (a fused weight split in two)."""

    def init(weight: torch.Tensor, generator: torch.Generator | None) -> None:
        out, in_ = fan_out or weight.shape[0], fan_in or weight.shape[1]
        bound = math.sqrt(6.0 / (in_ + out))
        nn.init.uniform_(weight, -bound, bound, generator=generator)

    return init


def standard_normal_init(weight: torch.Tensor, generator: torch.Generator | None) -> None:
    """N(0, 1): the distribution of torch.nn.Embedding's default weights."""
    nn.init.normal_(weight, generator=generator)


def uniform_fan_in_init(weight: torch.Tensor, generator: torch.Generator | None) -> None:
    """U(-1/sqrt(in), 1/sqrt(in)): the distribution of torch.nn.Linear's default weights."""
    bound = 1.0 / math.sqrt(weight.shape[1]) if weight.shape[1] else 0.0
    nn.init.uniform_(weight, -bound, bound, generator=generator)


def _shard_of_master(
    shape: tuple[int, int],
    partition_dim: int,
    group: ProcessGroup | None,
    init_method: InitMethod,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> nn.Parameter:
    # Always drawn in float32 (torch draws different numbers for different dtypes), so that the
    # values depend on neither the layout nor the parameter dtype.
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master, generator)
    shard = master.chunk(group_size(group), partition_dim)[group_rank(group)]
    param = nn.Parameter(shard.to(device=device, dtype=dtype).contiguous())
    param.partition_dim = partition_dim
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output features split across ``tp_group``.

    Input: the full ``[..., in_features]`` tensor, the same on every rank; with
    ``sequence_parallel`` instead this rank's slice of the sequence dimension (dim 0 of
    ``[s, b, h]``), all-gathered here. Output: ``[..., out_features / t]`` (this rank's
    features), or all of them when ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        tp_group: ProcessGroup | None = None,
        init_method: InitMethod = uniform_fan_in_init,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and gather_output:
            raise ConfigError(
                "ColumnParallelLinear: gather_output=True with sequence_parallel=True is not "
                "supported; leave the output split and follow with a RowParallelLinear"
            )
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.tp_group = tp_group
        self.out_per_rank = divide(out_features, group_size(tp_group), "out_features")
        self.weight = _shard_of_master(
            (out_features, in_features), 0, tp_group, init_method, generator, dtype, device
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype, device=device))
            self.bias.partition_dim = 0
        else:
            self.register_parameter("bias", None)

    def enter(self, x: torch.Tensor) -> tuple[torch.Tensor, WeightGradSlot | None]:
        """The input as this layer multiplies it: gathered over the sequence with
        ``sequence_parallel`` (its backward a reduce-scatter), else the same tensor, whose
        gradient is all-reduced in the backward; and the slot in which the products reading it
        leave their weight gradients, computed while that collective is in flight
        (column_entry). Column-parallel layers that read one input (as SwiGLU's gate and up
        projections do) can share one entry, and so one collective each way and one saved copy,
        as Megatron-Core's fused linear_fc1 has. Under autocast the input enters in its 16-bit
        type (enter_column_region)."""
        return enter_column_region(x, self.tp_group, self.sequence_parallel)

    def forward(
        self,
        x: torch.Tensor,
        add_bias: bool = True,
        entered: bool = False,
        slot: WeightGradSlot | None = None,
    ) -> torch.Tensor:
        """``add_bias=False`` leaves this rank's bias to the caller, to fuse with what follows
        (so the output must stay split: not with gather_output); ``entered``: ``x`` and ``slot``
        are what :meth:`enter` returned."""
        if not add_bias and self.gather_output:
            raise ConfigError("ColumnParallelLinear: add_bias=False needs gather_output=False")
        if not entered:
            x, slot = self.enter(x)
        y = linear(x, self.weight, self.bias if add_bias else None, slot=slot)
        return gather_from_region(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_per_rank} here), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input features split across ``tp_group``.

    Input: this rank's ``[..., in_features / t]`` slice (``input_is_parallel``, the output of a
    ColumnParallelLinear), or the full tensor, which is then split here. Output: the full
    ``[..., out_features]``, the same on every rank; with ``sequence_parallel`` this rank's
    slice of the sequence dimension (dim 0) instead: the sum is a reduce-scatter.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        tp_group: ProcessGroup | None = None,
        init_method: InitMethod = uniform_fan_in_init,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ConfigError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                "(its input comes from a ColumnParallelLinear)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.tp_group = tp_group
        self.in_per_rank = divide(in_features, group_size(tp_group), "in_features")
        self.weight = _shard_of_master(
            (out_features, in_features), 1, tp_group, init_method, generator, dtype, device
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            # Each rank adds it to its own rows only, so its gradient is partial.
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.tp_group)
        partial = linear(x, self.weight)
        # The bias comes after the sum: added before, it would be counted t times.
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.tp_group)
        else:
            y = reduce_from_region(partial, self.tp_group)
        # In the output's dtype, as autocast gives F.linear's own bias add (a 16-bit output
        # stays 16-bit, so a 16-bit residual stream does too).
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_per_rank} here), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across ``tp_group``.

    Input: token ids, the same on every rank. Output: ``[*ids.shape, embedding_dim]``, the same
    on every rank; with ``sequence_parallel`` the ids are ``[s, b]`` and the output is this
    rank's slice of the sequence dimension (dim 0). The vocabulary must be divisible by t (pad
    it: Megatron pads to a multiple of 128 t).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        sequence_parallel: bool = False,
        tp_group: ProcessGroup | None = None,
        init_method: InitMethod = standard_normal_init,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        per_rank = divide(num_embeddings, group_size(tp_group), "num_embeddings (vocabulary)")
        self.vocab_start = group_rank(tp_group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = _shard_of_master(
            (num_embeddings, embedding_dim), 0, tp_group, init_method, generator, dtype, device
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Ids owned by another rank look up row 0 and are zeroed: the sum across the group then
        # holds exactly one real row per id.
        elsewhere = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(elsewhere, 0)
        weight = self.weight
        if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
            # A 16-bit table (--half-weights): CPU's embedding backward sums a token's repeated
            # rows in 16 bits, where they soon stop adding up (CUDA's sums in fp32). Looking up
            # an fp32 copy gives the same rows and a gradient summed in fp32, rounded once.
            rows = F.embedding(local, weight.float()).to(weight.dtype)
        else:
            rows = F.embedding(local, weight)
        rows = rows.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(rows, self.tp_group)
        return reduce_from_region(rows, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} ({self.vocab_start}..{self.vocab_end} here), "
            f"{self.embedding_dim}, sequence_parallel={self.sequence_parallel}"
        )


def sync_sequence_parallel_grads(module: nn.Module, tp_group: ProcessGroup | None) -> None:
    """All-reduces, across ``tp_group``, the gradients of the parameters marked
    ``sequence_parallel`` (replicated parameters applied to one slice per rank: of the sequence,
    as RowParallelLinear's bias or a LayerNorm's weight, or of the heads, as --qk-layernorm's
    weights), so that each holds the full gradient.
    Call it after backward, before the optimizer step; one all-reduce per dtype."""
    if group_size(tp_group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in module.parameters():
        grad = grad_of(p)
        if getattr(p, "sequence_parallel", False) and grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=tp_group)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(reduced.view_as(g))
