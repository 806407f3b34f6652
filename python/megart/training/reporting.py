"""What the trainer reports: its progress and validation lines, the GPU's peak for MFU and
TensorBoard scalars."""

from __future__ import annotations

from typing import Any

import torch

from megart.errors import ConfigError
from megart.training.flops import PEAK_FLOPS


def peak_flops() -> tuple[float | None, str]:
    """The dense bf16 peak of this GPU, from its name, or None on CPU."""
    if not torch.cuda.is_available():
        return None, "CPU"
    name = torch.cuda.get_device_name()
    for key, peak in PEAK_FLOPS.items():
        if key in name:
            return peak, name
    return None, name


# TensorBoard tags, Megatron-LM's where it has one, for the figures of an iteration.
TENSORBOARD_TAGS = {
    "lm loss": "loss",
    "grad-norm": "grad_norm",
    "learning-rate": "lr",
    "tokens-per-second": "tokens_per_s",
    "tflops-per-gpu": "tflops_per_gpu",
    "mfu": "mfu",
    "pipeline-p2p-bytes": "pipeline_p2p_bytes",
    "lm loss validation": "valid_loss",
    "lm loss validation ppl": "valid_ppl",
    "lm loss test": "test_loss",
    "lm loss test ppl": "test_ppl",
}


def progress_line(fig: dict[str, Any], train_iters: int) -> str:
    mfu = f"{100 * fig['mfu']:.1f}%" if fig["mfu"] is not None else "n/a"
    return (
        f"iteration {fig['iteration']:>5}/{train_iters} | loss "
        f"{fig['loss']:.4f} | grad norm {fig['grad_norm']:.3f} | lr {fig['lr']:.2e} | "
        f"{fig['tokens_per_s']:,.0f} tokens/s | {fig['tflops_per_gpu']:.3f} TFLOP/s per "
        f"GPU | MFU {mfu}"
    )


def validation_line(fig: dict[str, Any], split: str = "valid") -> str:
    """Megatron's validation report, one line: of the validation range, or of the test range
    (``split="test"``) at the end of training."""
    if split == "valid":
        where = f"at iteration {fig['iteration']}"
    else:
        where = "at the end of training for test data"
    return (
        f"validation loss {where} | lm loss value: {fig[split + '_loss']:.4f} | lm loss PPL: "
        f"{fig[split + '_ppl']:.3f}"
    )


def tensorboard_writer(directory: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"--tensorboard-dir needs the tensorboard package ({e}); "
            "pip install 'megart[tensorboard]' or leave the flag out"
        ) from e
    return SummaryWriter(log_dir=directory)
