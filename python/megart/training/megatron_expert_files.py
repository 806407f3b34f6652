"""Expert parallelism in Megatron-LM's legacy files (``--ckpt-format torch`` at
--expert-model-parallel-size EP > 1), both ways.

Megatron-LM writes one file per (tensor, pipeline, expert-parallel) rank,
``mp_rank_TT[_PPP]_EEE`` (get_checkpoint_name). Each holds the dense parameters (the same in
every expert-parallel rank's file) and its E/EP experts of every MoE layer under SequentialMLP's
module names, ``mlp.experts.local_experts.i`` with ``i`` the LOCAL index (the plain
``state_dict()``; only the sharded one of torch_dist numbers experts globally): rank e's expert
i is the model's expert e x E/EP + i. megart names experts by their global index, so a file is
renumbered by that offset on the way out and back.

Its optimizer is Megatron-Core's ChainedOptimizer of two (get_megatron_optimizer: the experts'
parameters, ``allreduce`` False under expert parallelism, have their own optimizer over the
expert-data-parallel group), whose state dict is a list: the dense parameters' optimizer
state, then the experts'. Each is what the one optimizer of a model without expert parallelism
holds (megart.training.megatron_optimizer) for its own parameters, groups without parameters
left out (the experts have no 1-d parameters without biases) and the experts' groups keyed
``is_expert_parallel`` True.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

# A routed expert's parameter in a chunk's state dict (not a shared expert's: shared_experts).
EXPERT = re.compile(r"(?:^|\.)mlp\.experts\.\d+\.")
# A megart expert parameter's name around its (global) index.
_EXPERT_INDEX = re.compile(r"^((?:.*\.)?mlp\.experts\.)(\d+)(\..*)$")
# A rank's folder: mp_rank_TT, then _PPP with pipeline parallelism, then _EEE with experts'.
_PLACE = re.compile(r"mp_rank_(\d+)((?:_\d+)*)")


def is_expert(key: str) -> bool:
    """Whether the chunk's parameter ``key`` (megart's name) belongs to a routed expert (one
    expert-parallel rank's only)."""
    return EXPERT.search(key) is not None


def file_place(path: Any, pp: int, ep: int) -> tuple[int, int, int]:
    """(tensor, pipeline, expert-parallel) rank of a legacy file at ``path`` of a checkpoint
    saved at pipeline-parallel ``pp`` and expert-parallel ``ep`` (its folder's name); (0, 0, 0)
    for a file outside a rank folder."""
    match = _PLACE.fullmatch(Path(path).parent.name)
    if match is None:
        return 0, 0, 0
    rest = [int(n) for n in match.group(2).split("_")[1:]]
    p = rest.pop(0) if pp > 1 and rest else 0
    e = rest.pop(0) if ep > 1 and rest else 0
    return int(match.group(1)), p, e


def shift_name(name: str, shift: int) -> str:
    """A megart parameter's name with a routed expert's index moved by ``shift``."""
    match = _EXPERT_INDEX.match(name)
    if match is None:
        return name
    return f"{match.group(1)}{int(match.group(2)) + shift}{match.group(3)}"


def shifted(state: dict[str, Any], shift: int) -> dict[str, Any]:
    """A megart file's view (checkpoint_save.file_state's keys) with its experts renumbered by
    ``shift`` (the model's chunks and the optimizer's parameter names)."""
    if shift == 0:
        return state
    model = [{shift_name(k, shift): v for k, v in chunk.items()} for chunk in state["model"]]
    params = [(c, shift_name(n, shift)) for c, n in state.get("optimizer_params") or []]
    return {**state, "model": model, "optimizer_params": params}


def first_expert(ep_rank: int, ep: int, num_experts: int | None) -> int:
    """The global index of expert-parallel rank ``ep_rank``'s first expert (0 without expert
    parallelism, where a dense model has no experts)."""
    return ep_rank * (num_experts // ep) if ep > 1 else 0


def part_of_optimizer(
    optimizer: dict[str, Any], params: list[tuple[int, str]], experts: bool
) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """megart's Adam state dict restricted to its routed experts' parameters (``experts``) or
    to the others, every param group kept (empty ones too) and renumbered; with the (chunk,
    name) of each parameter in the new numbering."""
    ids = [i for group in optimizer["param_groups"] for i in group["params"]]
    named = dict(zip(ids, params, strict=True))
    state, groups, names = {}, [], []
    for group in optimizer["param_groups"]:
        numbers = []
        for i in group["params"]:
            if is_expert(named[i][1]) != experts:
                continue
            if i in optimizer["state"]:
                state[len(names)] = optimizer["state"][i]
            numbers.append(len(names))
            names.append(named[i])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    return {"state": state, "param_groups": groups}, names


def experts_groups(n_groups: int, biases: bool) -> list[int]:
    """Which of a rank's ``n_groups`` Megatron groups (decayed, [decoupled,] not) its experts'
    optimizer holds: those the experts of any rank's MoE layers fill, the decayed weights' and
    with ``biases`` the last. Megatron-Core 0.16.1's _get_param_groups gathers the groups' keys
    of every rank, so a pipeline rank without MoE layers holds them too, empty."""
    return [0, n_groups - 1] if biases else [0]


def experts_groups_only(
    optimizer: dict[str, Any], groups: list[list[Any]], biases: bool
) -> tuple[dict[str, Any], list[list[Any]]]:
    """A Megatron experts' optimizer state dict and its groups' members (all the rank's
    groups, ``groups``) cut to experts_groups's; the numbering is unchanged."""
    kept = experts_groups(len(groups), biases)
    cut = [optimizer["param_groups"][i] for i in kept]
    return {**optimizer, "param_groups": cut}, [groups[i] for i in kept]


def _place_of(group: dict[str, Any], n_groups: int) -> int:
    """Where a chain's optimizer's saved group goes among ``n_groups`` megart groups (its
    Megatron keys): the undecayed (wd_mult 0) last, --decoupled-lr's (an override, not
    ``default_config``) second of three, the decayed first."""
    if group.get("wd_mult", 1.0) == 0.0:
        return n_groups - 1
    return 1 if n_groups == 3 and not group.get("default_config", True) else 0


def with_groups_of(optimizer: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """A Megatron sub-optimizer's torch state dict with an empty group inserted wherever it
    has none of megart's groups (``sizes``: their sizes under megart's rules), each saved
    group placed by its keys, so that its groups line up with them; other shapes are
    returned as they are (and refused later)."""
    saved = optimizer["param_groups"]
    places = [_place_of(g, len(sizes)) for g in saved]
    if not saved or len(set(places)) != len(saved) or len(saved) == len(sizes):
        return optimizer
    filler = {k: v for k, v in saved[0].items() if k != "params"}
    groups = [{**filler, "params": []} for _ in sizes]
    for place, group in zip(places, saved, strict=True):
        groups[place] = group
    return {**optimizer, "param_groups": groups}


def saved_groups(groups: list[list[Any]], optimizer: dict[str, Any]) -> list[list[Any]]:
    """The members of each group one optimizer state dict of the chain holds, in its order
    (each placed by its keys among the rank's ``groups``)."""
    return [groups[_place_of(g, len(groups))] for g in optimizer["param_groups"]]


def joined_optimizer(
    parts: list[tuple[dict[str, Any], list[tuple[int, str]]]],
    order: list[list[tuple[int, str]]],
) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """megart's one Adam state dict from its parts' (state dict, names) (dense then experts, in
    the same param groups), numbered in ``order`` (megart's groups of all the parameters); each
    group's settings the first part's."""
    states: dict[tuple[int, str], Any] = {}
    for optimizer, names in parts:
        ids = [i for group in optimizer["param_groups"] for i in group["params"]]
        states.update(
            {names[n]: optimizer["state"][i] for n, i in enumerate(ids) if i in optimizer["state"]}
        )
    state, groups, index = {}, [], 0
    for members, group in zip(order, parts[0][0]["param_groups"], strict=True):
        numbers = list(range(index, index + len(members)))
        state.update({i: states[p] for i, p in zip(numbers, members, strict=True) if p in states})
        index += len(members)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
    return {"state": state, "param_groups": groups}, [p for g in order for p in g]


def split_model(
    chunks: list[dict[str, torch.Tensor]], experts: bool, megatron: bool
) -> list[dict[str, torch.Tensor]]:
    """Each chunk's routed experts' tensors (``experts``) or the others', under megart's or
    (``megatron``) Megatron-Core's names."""

    def expert(name: str) -> bool:
        return ".mlp.experts.local_experts." in name if megatron else is_expert(name)

    return [{k: v for k, v in chunk.items() if expert(k) == experts} for chunk in chunks]


# A Megatron-Core expert tensor's name around its index (local in legacy files).
_MEGATRON_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


def megatron_renumbered(chunk: dict[str, Any], shift: int) -> dict[str, Any]:
    """A Megatron-Core chunk state dict with each routed expert's index moved by ``shift``."""
    return {_MEGATRON_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + shift}.", k): v
            for k, v in chunk.items()}  # fmt: skip


def merged_megatron_chunks(
    files: list[list[dict[str, Any]]], num_experts: int | None
) -> list[dict[str, Any]]:
    """One (tensor, pipeline) rank's model chunks (Megatron-Core names) from its expert-
    parallel ranks' (``files[e]``: rank e's chunks): the dense tensors of rank 0's, every
    rank's experts under their global numbers, as a file saved without expert parallelism
    holds them."""
    ep = len(files)
    if ep == 1:
        return files[0]
    merged = [{k: v for k, v in chunk.items() if not _MEGATRON_EXPERT.search(k)}
              for chunk in files[0]]  # fmt: skip
    for e, chunks in enumerate(files):
        shift = first_expert(e, ep, num_experts)
        for whole, chunk in zip(merged, chunks, strict=True):
            own = {k: v for k, v in chunk.items() if _MEGATRON_EXPERT.search(k)}
            whole.update(megatron_renumbered(own, shift))
    return merged
