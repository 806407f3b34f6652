"""Optimizers on megart's multi-tensor sweeps: Adam/AdamW (torch-compatible), gradient-norm
clipping and dynamic loss scaling. CPU tensors use the C++ core; CUDA tensors the CUDA kernels
(run on one H200, 2026-11-26: tests/test_optim_cuda.py and megart selftest pass there)."""

from megart.optim.adam import Adam, AdamW
from megart.optim.clip import clip_grad_norm_, grad_sum_of_squares
from megart.optim.loss_scale import LossScaler, multi_tensor_scale_

__all__ = [
    "Adam",
    "AdamW",
    "clip_grad_norm_",
    "grad_sum_of_squares",
    "LossScaler",
    "multi_tensor_scale_",
]
