"""Fused kernels on torch tensors: CUDA when megart._cuda is built and the tensors are on a
GPU, a torch reference otherwise. (The multi-tensor helpers around the optimizer step live in
megart.optim.)"""

from megart.kernels.bias_gelu import bias_gelu
from megart.kernels.cross_entropy import fused_vocab_parallel_cross_entropy
from megart.kernels.layer_norm import add_layer_norm, layer_norm

__all__ = [
    "add_layer_norm",
    "bias_gelu",
    "fused_vocab_parallel_cross_entropy",
    "layer_norm",
]
