"""Tensor parallelism (Megatron-LM's intra-layer model parallelism) over an explicit group.

Every function and module here takes the tensor-parallel group as an argument: a
megart.distributed ProcessGroup, or None for no tensor parallelism (a group of one, usable in a
single process without ``megart.distributed.init()``).

- ``mappings``: the communication at the edges of tensor-parallel regions, as autograd functions.
- ``layers``: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.
- ``cross_entropy``: cross-entropy over vocabulary-split logits.
- ``random``: dropout streams, distinct per rank inside regions and shared outside.
- ``weight_grad``: the linear layers' weight gradients as megart computes them: zero-bubble's
  split backward, and gradient accumulation fusion (``fusing_accumulation``: a training loop
  whose parameters have ``.grad`` buffers wraps its forward and backward passes in it).
"""

from megart.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megart.tensor_parallel.layers import (
    ColumnParallelLinear,
    InitMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
    standard_normal_init,
    sync_sequence_parallel_grads,
    uniform_fan_in_init,
    xavier_uniform_init,
)
from megart.tensor_parallel.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
    scatter_to_sequence_region,
)
from megart.tensor_parallel.random import (
    TENSOR_PARALLEL,
    GeneratorStates,
    RNGStatesTracker,
    fork,
    seed_tensor_parallel,
)
from megart.tensor_parallel.weight_grad import fusing_accumulation, grad_of

__all__ = [
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
    "scatter_to_sequence_region",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "InitMethod",
    "normal_init",
    "standard_normal_init",
    "xavier_uniform_init",
    "uniform_fan_in_init",
    "sync_sequence_parallel_grads",
    "vocab_parallel_cross_entropy",
    "RNGStatesTracker",
    "GeneratorStates",
    "fork",
    "seed_tensor_parallel",
    "TENSOR_PARALLEL",
    "fusing_accumulation",
    "grad_of",
]
