"""Gradient-norm clipping over many tensors, with a hook for model-parallel groups."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from megart.errors import ConfigError, MegartError
from megart.optim._buffers import addresses, check_device, dtype_name, sizes

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def grad_sum_of_squares(grads: list[torch.Tensor], num_threads: int = 0) -> torch.Tensor:
    """Sum of squares of all elements of ``grads`` as a float64 tensor on the first grad's
    device. CPU tensors go through the C++ sweep (double accumulation across threads); CUDA
    tensors through torch (float64 norms)."""
    from megart import _core

    device = grads[0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        check_device(g, "a gradient")
        dtype_name(g.dtype, "a gradient")
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (dev, dtype), group in groups.items():
        if dev.type == "cpu":
            contiguous = [g if g.is_contiguous() else g.contiguous() for g in group]
            value = _core.optim.sum_of_squares(
                addresses(contiguous),
                sizes(contiguous),
                dtype_name(dtype, "a gradient"),
                num_threads,
            )
            total = total + torch.tensor(value, dtype=torch.float64).to(device)
        else:
            norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in group]
            total = total + torch.stack(norms).square().sum().to(device)
    return total


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    reduce_fn: ReduceFn | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Scales the gradients of ``parameters`` in place so that their global L2 norm is at most
    ``max_norm``; returns the norm before clipping, as torch.nn.utils.clip_grad_norm_ does.

    ``reduce_fn`` receives this rank's sum of squares (a float64 tensor) and returns the sum
    over the ranks that hold shards of the same model, e.g. an all-reduce over the tensor- and
    pipeline-parallel groups; every rank then clips with the same global norm.
    """
    if float(norm_type) != 2.0:
        raise ConfigError(f"megart's clip_grad_norm_ supports norm_type=2.0 only, got {norm_type}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    threads = num_threads or 0
    sum_sq = grad_sum_of_squares(grads, threads)
    if reduce_fn is not None:
        sum_sq = reduce_fn(sum_sq)
    # Reported in the gradients' dtype, like torch.
    total_norm = sum_sq.sqrt().to(grads[0].dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total_norm)):
        raise MegartError(
            f"the total norm of order {norm_type} for gradients is non-finite, so it cannot be "
            "clipped; pass error_if_nonfinite=False to clip anyway"
        )
    # torch's coefficient, computed the same way: max_norm / (norm + 1e-6), at most 1.
    clip_coef = torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)
    scale_grads_(grads, clip_coef, threads)
    return total_norm


def scale_grads_(
    grads: list[torch.Tensor], coef: float | torch.Tensor, num_threads: int = 0
) -> None:
    """Multiplies every tensor of ``grads`` by ``coef`` in place: a float, or a 0-dim tensor on
    any device (clip_grad_norm_'s coefficient, left on the device so CUDA grads need no host
    sync). Contiguous CPU grads go through megart's multi-tensor sweep, CUDA grads through
    torch's multi-tensor (foreach) kernel, one call per device, as
    torch.nn.utils.clip_grad_norm_ does. On the CPU every element is multiplied in float32 and
    rounded once to the grad's dtype: bitwise torch's ``g.mul_(coef)``."""
    from megart import _core

    def on(device: torch.device) -> float | torch.Tensor:
        return coef.to(device) if isinstance(coef, torch.Tensor) else coef

    cpu: dict[torch.dtype, list[torch.Tensor]] = {}
    cuda: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.device.type != "cpu":
            cuda.setdefault(g.device, []).append(g)
        elif g.is_contiguous():
            cpu.setdefault(g.dtype, []).append(g)
        else:
            # Rare enough for torch's kernel; not CPU foreach, which rounds a float coefficient
            # to a 16-bit grad's dtype before multiplying.
            g.mul_(on(g.device))
    for device, group in cuda.items():
        torch._foreach_mul_(group, on(device))
    if cpu:
        factor = float(coef)
        for dtype, group in cpu.items():
            ptrs = addresses(group)
            _core.optim.scale(
                ptrs, ptrs, sizes(group), dtype_name(dtype, "a gradient"), factor, num_threads
            )
