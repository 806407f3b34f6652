"""Where each parameter's initial values come from: a generator seeded by (model seed, the
parameter's place), so that a parameter's initial value does not depend on which stage or rank
builds it; and the distribution a weight is drawn from (weight_init).

Megatron-LM's --init-method-xavier-uniform sets TransformerConfig's init_method and the
output-layer one ("scaled_init_method") to torch's xavier_uniform_, and the embeddings follow
init_method (embedding_init_method). In megatron-core 0.16.1 and since, the flag fails: the
output-layer one is passed under a name TransformerConfig does not have (a TypeError at
startup), so megart follows the evident intent: every weight drawn from a normal otherwise,
the embeddings and the output projections included, is U(-a, a), a = sqrt(6 / (fan_in +
fan_out)), and there is no std and so no output-layer scaling. The fans are those of the whole
tensor Megatron-Core holds (its _initialize_affine_weight_cpu draws that master weight; its
default GPU path draws each rank's shard with the shard's fans, so its bound changes with the
tensor-parallel size, which megart's does not): the fused qkv, SwiGLU's fused fc1 (2 ffn rows,
though megart keeps gate and up apart), and the vocabulary padded as at tensor-parallel size 1.
"""

from __future__ import annotations

import hashlib

import torch

from megart.models.config import GPTConfig
from megart.tensor_parallel import InitMethod, normal_init, xavier_uniform_init


def generator(seed: int, *where: object) -> torch.Generator:
    """A generator for one parameter, seeded by the model seed and the parameter's place."""
    digest = hashlib.sha256(repr((seed, *where)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def weight_init(cfg: GPTConfig, std: float, shape: tuple[int, int]) -> InitMethod:
    """How a weight is drawn: N(0, std^2), or with --init-method-xavier-uniform Glorot's
    uniform with the fans of ``shape`` ([out, in]: the whole tensor Megatron-Core holds)."""
    return xavier_uniform_init(*shape) if cfg.init_method_xavier_uniform else normal_init(std)
