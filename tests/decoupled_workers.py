"""Launched pieces of the --decoupled-lr tests: Megatron-Core's param groups for a model, and
a megart run's groups and rates."""

from __future__ import annotations

import train_workers as tw
from megart.models.megatron_names import NAMES
from megart.training.data import builtin_corpus
from megart.training.trainer import Trainer


def megatron_core_groups(model_kw: dict, lr: float, min_lr: float, dlr: float, dmin) -> list:
    """Megatron-Core's _get_param_groups of its one-process GPTModel with decoupled_lr: per
    group, its keys (max_lr, min_lr, wd_mult, ...) and the names of its parameters."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    import megatron_core_workers as mcw
    from megart.models.config import GPTConfig

    model = mcw.megatron_model(GPTConfig(**model_kw))
    config = OptimizerConfig(lr=lr, min_lr=min_lr, decoupled_lr=dlr, decoupled_min_lr=dmin,
                             weight_decay=0.1)  # fmt: skip
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        {k: v for k, v in g.items() if k != "params"}
        | {"names": sorted(names[id(p)] for p in g["params"])}
        for g in _get_param_groups([model], config, None)
    ]


def megart_groups(kw: dict) -> list:
    """This rank's optimizer groups after two iterations: hyperparameters, the rate each was
    stepped with, and its parameters under Megatron-Core's names where they have one."""
    trainer = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
    trainer.train_step(0)
    trainer.train_step(1)
    names = {id(p): n for c in trainer.chunks for n, p in c.named_parameters()}
    return [
        dict(
            lr=g["lr"],
            max_lr=g.get("max_lr"),
            min_lr=g.get("min_lr"),
            weight_decay=g["weight_decay"],
            names=sorted(NAMES.get(names[id(p)], names[id(p)]) for p in g["params"]),
        )  # fmt: skip
        for g in trainer.optimizer.param_groups
    ]
