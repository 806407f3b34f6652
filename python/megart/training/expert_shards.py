"""An expert-parallel checkpoint's files merged into the files one expert-parallel rank would
have written, so that every whole-tensor reader (megart.training.shards: resharding on load,
export-hf, convert-checkpoint) takes it as it takes any other.

Under --expert-model-parallel-size EP each (tensor, pipeline) rank has EP files,
``mp_rank_TT[_PPP]_EEE`` (megart.training.checkpoint_save): expert-parallel rank e's holds the
model's dense parameters (the same in every one of them: they are averaged over all the
data-parallel ranks, which the expert-parallel ranks are) and its E/EP experts of every MoE
layer, named by their global index (``blocks.N.mlp.experts.E.*``, as models.moe names them with
or without expert parallelism). Merged, a pipeline rank's file holds the dense parameters of
expert-parallel rank 0's file and every rank's experts, each under its own name; its optimizer
state likewise: each parameter's Adam state, renumbered into the saved param groups, and named
in ``optimizer_params`` (megart.training.reshard maps the states to parameters by those names).
Expert-parallel rank 0's file gives the rest (the iteration, the loss scale, the records).
The distributed optimizer's files are no different: each holds its experts' whole moments,
gathered over their expert-data-parallel group (megart.training.distributed_optimizer).
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from typing import Any

from megart.errors import ConfigError
from megart.training.ckpt_files import EXPERT_PARALLEL
from megart.training.megatron_expert_files import is_expert


def merge_expert_files(root: Path, pp_rank: int, files: list[dict[str, Any]]) -> dict[str, Any]:
    """Pipeline rank ``pp_rank``'s files (read_file's dicts, in expert-parallel rank order) as
    the one file of all its experts; one file is returned as it is."""
    if len(files) == 1:
        return files[0]
    first = files[0]
    where = f"{root}, pipeline rank {pp_rank}"
    for e, f in enumerate(files[1:], 1):
        if [list(ids) for ids in f["layer_ids"]] != [list(ids) for ids in first["layer_ids"]]:
            raise ConfigError(
                f"{where}: expert-parallel rank {e}'s file holds layers {f['layer_ids']}, rank "
                f"0's {first['layer_ids']}; were the files written by one training job?"
            )
    model = [dict(chunk) for chunk in first["model"]]
    for e, f in enumerate(files[1:], 1):
        for c, chunk in enumerate(f["model"]):
            for key, value in chunk.items():
                if not is_expert(key):
                    continue  # the dense parameters: expert-parallel rank 0's copy
                if key in model[c]:
                    raise ConfigError(
                        f"{where}: expert-parallel rank {e}'s file holds {key} of model chunk "
                        f"{c}, which an earlier rank's file holds too; each expert must be in "
                        "one file only"
                    )
                model[c][key] = value
    params, optimizer = _merged_optimizer(where, files)
    return {
        **first,
        "config": {k: v for k, v in first["config"].items() if k != EXPERT_PARALLEL},
        "model": model,
        "optimizer_params": params,
        "optimizer": optimizer,
    }


def _merged_optimizer(
    where: str, files: list[dict[str, Any]]
) -> tuple[list[tuple[int, str]], dict[str, Any] | None]:
    """(optimizer_params, optimizer state dict) of the merged file: each file's parameters in
    its param groups (rank 0's all, the other ranks' experts), numbered in group order."""
    if any(f["optimizer"] is None for f in files):  # --no-save-optim: none in any
        return [], None
    groups = [len(f["optimizer"]["param_groups"]) for f in files]
    counts = [sum(len(g["params"]) for g in f["optimizer"]["param_groups"]) for f in files]
    if len(set(groups)) > 1 or counts != [len(f["optimizer_params"]) for f in files]:
        raise ConfigError(
            f"{where}: the expert-parallel ranks' optimizer states do not name their parameters "
            f"in the same param groups ({groups}); resume with --no-load-optim (fresh "
            "optimizer state) or at the layout it was saved at"
        )
    # Each group's parameters (name, Adam state or None), then numbered group by group, as a
    # state dict numbers them and optimizer_params lists them.
    entries: list[list[tuple[tuple[int, str], Any]]] = [[] for _ in range(groups[0])]
    for e, f in enumerate(files):
        optim = f["optimizer"]
        ids = [i for group in optim["param_groups"] for i in group["params"]]
        named = dict(zip(ids, [(int(c), str(k)) for c, k in f["optimizer_params"]], strict=True))
        for g, group in enumerate(optim["param_groups"]):
            entries[g] += [
                (named[i], optim["state"].get(i))
                for i in group["params"]
                if e == 0 or is_expert(named[i][1])
            ]
    names = [name for group in entries for name, _ in group]
    states = [s for group in entries for _, s in group]
    state = {i: s for i, s in enumerate(states) if s is not None}
    ends = list(accumulate(len(group) for group in entries))
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(end - n, end))}
        for group, n, end in zip(
            files[0]["optimizer"]["param_groups"], map(len, entries), ends, strict=True
        )
    ]
    return names, {"state": state, "param_groups": param_groups}
