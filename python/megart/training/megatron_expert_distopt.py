"""Megatron-LM's legacy ``distrib_optim.pt`` under expert parallelism (``--ckpt-format torch
--use-distributed-optimizer --expert-model-parallel-size EP``), both ways.

Megatron-Core 0.16.1 (optimizer/__init__.py get_megatron_optimizer, optimizer.py
ChainedOptimizer, distributed/distributed_data_parallel.py; Megatron-LM's
training/checkpointing.py): the model's parameters go into two buffer sets, the dense ones
(``buffers``, sharded over data x context parallelism) and the experts' (``expert_parallel_
buffers``, sharded over the expert-data-parallel group, dp x cp / EP ranks), each laid out and
bucketed as megart.training.megatron_distrib_optim describes (the same bucket size, which
--ddp-num-buckets takes from all the rank's parameters). A DistributedOptimizer over each, the
dense one first, make a ChainedOptimizer. Its state_dict() in the rank file is the list of the
two DistributedOptimizer.state_dict()s (param groups without parameters, the experts' keyed
``is_expert_parallel`` True). Every rank calls save_parameter_state with the distrib_optim.pt
beside its own rank file (mp_rank_TT[_PPP]_EEE): each optimizer gathers its buffers' vectors
(get_parameter_state_dp_zero) onto rank 0 of its own group, and a rank that is rank 0 of
either group writes the list ``[dense state, experts' state]``, None for the group whose rank
0 it is not. So the file of expert-parallel rank e holds its experts' vectors; the dense
vectors are in expert-parallel rank 0's file only (rank 0 of data parallelism is expert-
parallel rank 0), None in the others. Loading reads each list entry on its group's rank 0.

Here the chain in the non-distributed layout (megart.training.megatron_files' list of two
optimizer state dicts) is split, part by part, with the single optimizer's code over the part's
parameters, and joined back the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.training import megatron_distrib_optim as distopt
from megart.training import megatron_expert_files as experts
from megart.training.megatron_files import model_chunks, rank_state

PARTS = (False, True)  # the chain's order: the dense parameters' optimizer, then the experts'


def _part(state: dict[str, Any], experts_part: bool, optimizer: Any) -> dict[str, Any]:
    """The rank file restricted to one buffer set's parameters, with that set's optimizer."""
    chunks = experts.split_model(model_chunks(state), experts_part, megatron=True)
    return {**rank_state(state["args"], state["iteration"], chunks), "optimizer": optimizer}


def _sizes(state: dict[str, Any]) -> tuple[int, dict[bool, int]]:
    """All the rank's parameters' elements, and each set's sharding group's size."""
    args = vars(state["args"])
    chunks = model_chunks(state)
    total = sum(v.numel() for c in chunks for v in c.values() if isinstance(v, torch.Tensor))
    dp_cp = distopt.dp_cp_size(args)
    return total, {False: dp_cp, True: dp_cp // int(args["expert_model_parallel_size"])}


def is_chained(optimizer: Any) -> bool:
    """Whether a rank file's optimizer is expert parallelism's chain of two distributed
    optimizers' state dicts."""
    return (
        isinstance(optimizer, list)
        and len(optimizer) == 2
        and all(distopt.is_distributed(o) for o in optimizer)
    )


def split(
    state: dict[str, Any], pp_rank: int, dense_writer: bool
) -> tuple[dict[str, Any], list[Any]]:
    """A rank file of the chain in the non-distributed layout (to_megatron_file's at EP > 1) as
    the chained distributed optimizers write it: the file with their state_dict()s, and its
    distrib_optim.pt's list, the dense vectors only where ``dense_writer`` (rank 0 of data
    parallelism), else None."""
    total, shard = _sizes(state)
    optimizers, vectors = [], []
    for sub, part in zip(state["optimizer"], PARTS, strict=True):
        written, param_state = distopt.split(_part(state, part, sub), pp_rank, total, shard[part])
        optimizers.append(written["optimizer"])
        vectors.append(param_state if part or dense_writer else None)
    return {**state, "optimizer": optimizers}, vectors


def _dense_vectors(path: Path) -> Any:
    """The dense optimizer's state, in expert-parallel rank 0's distrib_optim.pt (the rank
    folder's last number is the expert-parallel rank)."""
    folder = path.parent.name
    first = path.parent.parent / f"{folder[: folder.rindex('_') + 1]}000" / path.name
    dense = distopt.read_param_state(first, chain=2)[0]
    if dense is None:
        raise ConfigError(
            f"{first.parent / distopt.DISTRIB_FILE} holds no dense optimizer state (written "
            "by data-parallel rank 0, which is expert-parallel rank 0's)"
        )
    return dense


def join(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """A rank file the distributed optimizer wrote, with its distrib_optim.pt, in the non-
    distributed layout: expert parallelism's chain of two (each part's vectors joined over the
    part's parameters) or one optimizer (megatron_distrib_optim.join); other files as they
    are."""
    optimizer = state.get("optimizer")
    if not is_chained(optimizer):
        return distopt.join(state, path)
    loaded = distopt.read_param_state(path, chain=2)
    if loaded[1] is None:
        raise ConfigError(
            f"{path.parent / distopt.DISTRIB_FILE} holds no expert optimizer state (each "
            "expert-parallel rank's file holds its experts')"
        )
    if loaded[0] is None:
        loaded = [_dense_vectors(path), loaded[1]]
    total, shard = _sizes(state)
    parts = [
        distopt.join(_part(state, part, sub), path, vectors, total, shard[part])["optimizer"]
        for sub, vectors, part in zip(optimizer, loaded, PARTS, strict=True)
    ]
    return {**state, "optimizer": parts}
