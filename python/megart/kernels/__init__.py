"""Fused and multi-tensor kernels on torch tensors: CUDA when megart._cuda is built and the
tensors are on a GPU, a torch reference otherwise."""

from megart.kernels.multi_tensor import multi_tensor_scale_

__all__ = ["multi_tensor_scale_"]
