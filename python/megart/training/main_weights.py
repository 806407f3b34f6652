"""16-bit weights with fp32 main weights in the optimizer (--half-weights), as Megatron-LM keeps
them under --bf16/--fp16 (its Float16OptimizerWithFloat16Params).

The model's parameters are 16-bit, so the forward and backward read them without autocast's
per-iteration copies; their gradients accumulate in fp32 apart from them (``param.main_grad``,
megart.training.grad_sync). The optimizer steps fp32 copies of the parameters, the main weights,
whose ``.grad`` is that fp32 gradient, and rounds them into the parameters after each step. Per
parameter that is 2 bytes of weight, 4 of gradient, 4 of main weight and 8 of Adam's moments,
where fp32 weights under autocast hold 4 + 4 + 8 and a 16-bit copy of each weight for the
iteration. The distributed optimizer shards the main weights as it shards the moments
(megart.training.distributed_optimizer).

:class:`MainWeights` is the optimizer without the distributed optimizer. It looks like a torch
optimizer over the model's parameters: its ``param_groups`` hold them (so the learning rate is
set there), its ``state`` is keyed by them, and its state dicts are those of a plain optimizer
over them. Checkpoints hold the fp32 main weights as the model's weights: the trainer saves and
loads inside :meth:`MainWeights.full_precision`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class MainWeights:
    """Steps fp32 main weights of the 16-bit parameters in ``param_groups`` (torch.optim-style
    groups, each parameter with its ``main_grad``) with the optimizer ``make_optimizer``
    builds, and rounds them into the parameters."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    ) -> None:
        self.param_groups = param_groups
        self.params = [p for g in param_groups for p in g["params"]]
        self.mains: list[torch.Tensor] = []
        for p in self.params:
            main = p.detach().to(torch.float32, copy=True)
            main.grad = p.main_grad
            self.mains.append(main)
        main_of = {id(p): m for p, m in zip(self.params, self.mains, strict=True)}
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [main_of[id(p)] for p in g["params"]]}
            for g in param_groups
        ]  # fmt: skip
        self.optimizer = make_optimizer(inner_groups)

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The inner optimizer's state of each parameter's main weight, keyed by the parameter."""
        inner = self.optimizer.state
        return {p: inner[m] for p, m in zip(self.params, self.mains, strict=True) if m in inner}

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    def step(self) -> None:
        """Steps the main weights with the hyperparameters now in ``param_groups``, then rounds
        them into the parameters."""
        self._sync_hyperparameters()
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.mains)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Nothing: the gradient buckets zero the fp32 gradients."""

    def state_dict(self) -> dict[str, Any]:
        """A plain optimizer's state dict over the parameters (the main weights' states,
        numbered as the parameters are)."""
        self._sync_hyperparameters()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        for outer, loaded in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            outer.update({k: v for k, v in loaded.items() if k != "params" and k in outer})

    @contextlib.contextmanager
    def full_precision(self) -> Iterator[None]:
        """For the duration each parameter holds its fp32 main weight, so that checkpoints
        write and read fp32 weights; what is loaded into them stays the main weights and,
        rounded, becomes the parameters."""
        halves = [p.data for p in self.params]
        for p, main in zip(self.params, self.mains, strict=True):
            p.data = main
        try:
            yield
        finally:
            for p, half, main in zip(self.params, halves, self.mains, strict=True):
                half.copy_(main)
                p.data = half
