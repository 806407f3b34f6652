"""Adam and AdamW on megart's multi-tensor sweeps.

Drop-in for ``torch.optim.Adam`` / ``torch.optim.AdamW`` (maximize=False, amsgrad=False): same
constructor arguments, param groups, state keys ('step' as a float32 tensor, 'exp_avg',
'exp_avg_sq'), and state dicts that either optimizer loads. CPU tensors go to the C++ sweep (one
pass per element, all tensors of a group split across threads); CUDA tensors to the CUDA kernels
(run on one H200, 2026-11-26: they match torch.optim.AdamW(fused=True); bench/RESULTS.md).

Low-precision (bf16/fp16) parameters need ``master_weights=True``: the optimizer then keeps fp32
main weights (state 'master_param') and fp32 moments, and each step writes the main weights and
the low-precision parameter in the same pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch

from megart.errors import ConfigError
from megart.optim._buffers import (
    LOW_PRECISION,
    addresses,
    check_device,
    cuda_module,
    dtype_name,
    sizes,
)

# Group keys torch.optim.Adam keeps; megart keeps them too (with the only values it supports)
# so that state dicts load both ways.
_TORCH_GROUP_DEFAULTS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}


class _Bucket:
    """Tensors of one group on one device with one model dtype: one sweep or one launch set."""

    def __init__(self, device: torch.device, model_dtype: torch.dtype) -> None:
        self.device = device
        self.model_dtype = model_dtype
        self.params: list[torch.Tensor] = []  # fp32 params or fp32 main weights
        self.model_params: list[torch.Tensor] = []  # low-precision copies (empty for fp32)
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []


def _tensor_lists(bucket: _Bucket) -> dict[str, Any]:
    """The buffers of a bucket as the CPU sweep and the CUDA kernel both take them."""
    return {
        "params": addresses(bucket.params),
        "model_params": addresses(bucket.model_params),
        "grads": addresses(bucket.grads),
        "exp_avgs": addresses(bucket.exp_avgs),
        "exp_avg_sqs": addresses(bucket.exp_avg_sqs),
        "steps": addresses(bucket.steps),
        "sizes": sizes(bucket.params),
        "model_dtype": dtype_name(bucket.model_dtype, "a parameter"),
    }


def _check_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, amsgrad: bool
) -> None:
    if amsgrad:
        raise ConfigError("amsgrad=True is not supported by megart's Adam; use amsgrad=False")
    if not 0.0 <= float(lr):
        raise ConfigError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ConfigError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= float(betas[0]) < 1.0:
        raise ConfigError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= float(betas[1]) < 1.0:
        raise ConfigError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ConfigError(f"Invalid weight_decay value: {weight_decay}")


class Adam(torch.optim.Optimizer):
    """torch.optim.Adam's update (L2 weight decay added to the gradient) on megart's sweeps.

    ``decoupled_weight_decay=True`` gives AdamW, as in torch. ``master_weights`` keeps fp32 main
    weights for bf16/fp16 parameters. ``num_threads`` (CPU only) overrides the environment
    variable MEGART_NUM_THREADS and the default of one thread per available CPU.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        decoupled_weight_decay: bool = False,
        master_weights: bool = False,
        num_threads: int | None = None,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay, amsgrad)
        if num_threads is not None and num_threads < 1:
            raise ConfigError(f"num_threads must be at least 1, got {num_threads}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            **_TORCH_GROUP_DEFAULTS,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.num_threads = num_threads or 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in _TORCH_GROUP_DEFAULTS.items():
                group.setdefault(key, value)
            group.setdefault("decoupled_weight_decay", False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this class or of torch.optim.Adam/AdamW.

        torch casts loaded moments to the parameter's dtype; with master weights megart keeps
        them (and the main weights) in fp32, so they are restored at full precision here.
        """
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        id_map = dict(zip(saved_ids, params, strict=False))
        super().load_state_dict(state_dict)
        for saved_id, param in id_map.items():
            saved = state_dict["state"].get(saved_id)
            if saved is None or param.dtype not in LOW_PRECISION:
                continue
            state = self.state[param]
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                value = saved.get(key)
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device=param.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """One optimizer step. ``found_inf`` (a flag tensor, nonzero to skip) lets a loss scaler
        skip the step on overflow: on CPU it is read here; on CUDA the kernels read it on the
        device, so no host synchronisation happens."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if found_inf is not None and found_inf.device.type == "cpu" and bool(found_inf.item()):
            return loss
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ConfigError(
                    "megart's Adam supports amsgrad=False and maximize=False only; this param "
                    "group asks for another"
                )
            for bucket in self._buckets(group):
                if bucket.device.type == "cpu":
                    self._step_cpu(group, bucket)
                else:
                    self._step_cuda(group, bucket, found_inf)
        return loss

    def _buckets(self, group: dict[str, Any]) -> list[_Bucket]:
        buckets: dict[tuple[torch.device, torch.dtype], _Bucket] = {}
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            check_device(p, "a parameter")
            check_device(grad, "a gradient")
            if torch.is_complex(p):
                raise ConfigError("megart's Adam does not support complex parameters")
            dtype_name(p.dtype, "a parameter")
            if not p.is_contiguous():
                raise ConfigError(
                    f"megart's Adam needs contiguous parameters; got one of shape "
                    f"{tuple(p.shape)} with strides {p.stride()}"
                )
            low = p.dtype in LOW_PRECISION
            if low and not self.master_weights:
                raise ConfigError(
                    f"a {p.dtype} parameter needs fp32 main weights: construct the optimizer "
                    "with master_weights=True"
                )
            state = self._state(p, low)
            key = (p.device, p.dtype)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = _Bucket(p.device, p.dtype)
            bucket.grads.append(grad if grad.is_contiguous() else grad.contiguous())
            if low:
                bucket.params.append(state["master_param"])
                bucket.model_params.append(p)
            else:
                bucket.params.append(p)
            bucket.exp_avgs.append(state["exp_avg"])
            bucket.exp_avg_sqs.append(state["exp_avg_sq"])
            bucket.steps.append(state["step"])
        return list(buckets.values())

    def _state(self, p: torch.Tensor, low: bool) -> dict[str, Any]:
        """The parameter's state, created on first use and brought into the sweep's layout (fp32
        contiguous moments, a float32 step next to the data) after loading a state dict."""
        state = self.state[p]
        if not state:
            # torch keeps a CPU step for its for-loop path and a device step when fused.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if low:
                state["master_param"] = p.detach().to(torch.float32, copy=True)
            return state
        step = state["step"]
        if not isinstance(step, torch.Tensor):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
        elif step.dtype != torch.float32 or step.device != p.device:
            state["step"] = step.to(device=p.device, dtype=torch.float32)
        if low and "master_param" not in state:
            # Loaded from an optimizer that had no main weights: start them from the model.
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        for key in ("exp_avg", "exp_avg_sq", "master_param") if low else ("exp_avg", "exp_avg_sq"):
            value = state[key]
            # The sweeps take p.numel() elements from each buffer by address: a loaded state of
            # another shape would be read and written out of bounds.
            if value.shape != p.shape:
                raise ConfigError(
                    f"optimizer state '{key}' has shape {tuple(value.shape)} but its parameter "
                    f"{tuple(p.shape)}; load a state dict saved for this model"
                )
            if (
                value.dtype != torch.float32
                or value.device != p.device
                or not value.is_contiguous()
            ):
                state[key] = value.to(
                    device=p.device, dtype=torch.float32, memory_format=torch.contiguous_format
                )
        return state

    def _hyperparameters(self, group: dict[str, Any]) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
        )

    def _step_cpu(self, group: dict[str, Any], bucket: _Bucket) -> None:
        from megart import _core

        _core.optim.adam_step(
            **_tensor_lists(bucket),
            num_threads=self.num_threads,
            **self._hyperparameters(group),
        )

    def _step_cuda(
        self, group: dict[str, Any], bucket: _Bucket, found_inf: torch.Tensor | None
    ) -> None:
        cuda = cuda_module()
        flag = 0
        if found_inf is not None:
            # Allocated on the current stream, the one the kernels run on, so it stays valid
            # for them even after Python drops it.
            found_inf = found_inf.to(device=bucket.device, dtype=torch.int32)
            flag = found_inf.data_ptr()
        with torch.cuda.device(bucket.device):
            stream = torch.cuda.current_stream(bucket.device).cuda_stream
            cuda.multi_tensor_adam(
                **_tensor_lists(bucket),
                found_inf=flag,
                stream=stream,
                **self._hyperparameters(group),
            )


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2) on megart's sweeps."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        master_weights: bool = False,
        num_threads: int | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            decoupled_weight_decay=True,
            master_weights=master_weights,
            num_threads=num_threads,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # As torch.optim.AdamW: loading any state keeps the decay decoupled.
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
