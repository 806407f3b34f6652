"""Loading a checkpoint under another parallel layout (resharding), in every rank, on load.

Megatron-LM reshards offline (tools/checkpoint with --target-tensor/pipeline-parallel-size);
megart does it when ``--load`` finds a checkpoint saved under other tensor- or pipeline-
parallel sizes, another virtual-stage layout or another expert-parallel size (the model must be
the same: see megart.training.checkpoint.load). An expert-parallel checkpoint's files of a
pipeline rank are merged first (megart.training.expert_shards: each expert by its global
index), and a rank of an expert-parallel run takes its own experts of the whole. Each rank
reads, memory-mapped, the files of the saved pipeline ranks that hold its layers, merges the
whole tensors of its own chunks' parameters through megart.training.shards (the exporter's
path) and takes its own tensor-parallel slice. The vocab-parallel embedding's zero padding (to
a multiple of 128 t) is cut or added first, and a last stage takes the tied embedding from the
saved first stage (the copies are kept equal).

Adam's per-parameter states (exp_avg, exp_avg_sq, and fp32 main weights where stored: every
state shaped like its parameter) are resharded the same way, mapped to parameter names by the
names the checkpoint saved (or by the Trainer's order in older ones); the step is the same on
every rank. The random streams are not resharded: a stream's state belongs to one rank's place
in the old layout, and no state of the new layout would continue what it would have drawn.
Data-parallel size changes need none of this: data-parallel ranks hold the same state, and
each one reads the file of its (tensor, pipeline) rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models import GPTChunk
from megart.models.config import VOCAB_MULTIPLE
from megart.models.stages import rank_layer_counts
from megart.models.vocab import fit_vocab
from megart.training.ckpt_files import (
    FILE,
    PARALLEL_FIELDS,
    optimizer_params,
    rank_dir,
    saved_expert_parallel,
)
from megart.training.megatron_files import torch_load
from megart.training.shards import (
    Shards,
    file_layer_ids,
    read_shards,
    split_shard,
    whole_name,
    whole_tensors,
)

# (chunk, parameter name) -> the optimizer state of that parameter
States = dict[tuple[int, str], dict[str, Any]]


def restore(
    root: Path,
    saved: dict[str, Any],
    config: Any,
    grid: Any,
    chunks: list[GPTChunk],
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Loads checkpoint ``root``, saved under layout ``saved`` (a file's "config"), into this
    rank's model chunks and, when given, ``optimizer`` (its param groups' hyperparameters
    too, as an unresharded load does)."""
    cfg = chunks[0].cfg
    shards = read_shards(root, _pipeline_ranks(root, saved, chunks), announce=False)
    mine = {
        (c, key): (whole_name(key, chunk.layer_ids), p)
        for c, chunk in enumerate(chunks)
        for key, p in chunk.named_parameters()
    }
    wanted = {name for name, _ in mine.values()}
    whole = whole_tensors(shards, cfg, wanted=wanted)
    missing = sorted(wanted - set(whole))
    if missing:
        raise ConfigError(f"{root}: no file holds {', '.join(missing)}; is it incomplete?")
    for c, chunk in enumerate(chunks):
        chunk.load_state_dict(
            {
                key: _slice(whole[name], p, name, config.tp, grid.tp_rank)
                for (cc, key), (name, p) in mine.items()
                if cc == c
            }
        )
    if optimizer is not None:
        optimizer.load_state_dict(
            _optimizer_state(root, shards, chunks, optimizer, mine, config, grid)
        )


def needed(state: dict[str, Any], config: Any, chunks: list[GPTChunk]) -> bool:
    """Whether file ``state`` (this rank's, or any when it has none) was saved under another
    layout than this run's: other parallel sizes (the expert-parallel one too), or other
    layers in this rank's chunks (as another uneven-stage split gives, or another
    --make-vocab-size-divisible-by, which pads the vocabulary to another size)."""
    saved = state["config"]
    saved_config = state.get("model_config") or {}
    multiple = saved_config.get("make_vocab_size_divisible_by", VOCAB_MULTIPLE)
    return (
        any(saved[f] != getattr(config, f) for f in PARALLEL_FIELDS)
        or saved_expert_parallel(state) != _expert_parallel(config)
        or [list(ids) for ids in state.get("layer_ids", [])]
        != [list(chunk.layer_ids) for chunk in chunks]
        or multiple != chunks[0].cfg.make_vocab_size_divisible_by
    )


def describe(
    directory: str | os.PathLike,
    iteration: int,
    saved: dict[str, Any],
    config: Any,
    saved_counts: list[int],
) -> str:
    """The one line a resharded load prints (``saved_counts``: the layers of each saved
    pipeline rank, see saved_layers)."""

    was, now = saved_expert_parallel({"config": saved}), _expert_parallel(config)

    def layout(tp: int, pp: int, per: int | None, layers: list[int], ep: int) -> str:
        v = "" if per is None else f" (v {config.num_layers // (pp * per)})"
        e = f" x ep {ep}" if max(was, now) > 1 else ""
        return f"tp {tp} x pp {pp}{v}{e}, layers per stage {' | '.join(map(str, layers))}"

    before = layout(*(saved[f] for f in PARALLEL_FIELDS), saved_counts, was)
    counts = rank_layer_counts(config.num_layers, config.pp, **config.stages)
    after = layout(*(getattr(config, f) for f in PARALLEL_FIELDS), counts, now)
    return (
        f"megart train: --load {directory}: iteration {iteration} was saved under {before}, "
        f"resharded to {after}; its random streams cannot be resharded, so this run keeps its "
        f"own, seeded from --seed {config.seed}"
    )


def _expert_parallel(config: Any) -> int:
    """This run's expert-parallel size (1 for a config without the field)."""
    return getattr(config, "expert_model_parallel_size", 1)


def _pipeline_ranks(root: Path, saved: dict[str, Any], chunks: list[GPTChunk]) -> set[int]:
    """The saved pipeline ranks whose files hold what ``chunks`` need: their layers, and the
    first layer's stage for the embeddings, the last one's for the final norm."""
    layers = {i for chunk in chunks for i in chunk.layer_ids}
    if any(chunk.first or chunk.last for chunk in chunks):
        layers.add(0)  # the tied embedding is taken from the first stage's copy
    return {p for p, held in saved_layers(root, saved, chunks[0].cfg).items() if held & layers}


def saved_layers(root: Path, saved: dict[str, Any], cfg: Any) -> dict[int, set[int]]:
    """The layers each saved pipeline rank holds, as its tensor rank 0 file records them (an
    uneven split is known only from the files): opened memory-mapped and unverified here, the
    files then read are verified."""
    pp, ep = saved["pipeline_model_parallel_size"], saved_expert_parallel({"config": saved})
    out = {}
    for p in range(pp):
        path = root / rank_dir(0, p, pp, 0, ep) / FILE
        if not path.is_file():
            raise ConfigError(f"{path} is missing: the checkpoint is incomplete")
        out[p] = {i for ids in file_layer_ids(torch_load(path, mmap=True), p, pp, cfg) for i in ids}
    return out


def _slice(whole: torch.Tensor, p: torch.Tensor, name: str, tp: int, rank: int) -> torch.Tensor:
    """This rank's shard of ``whole`` (parameter ``p``'s tensor, or a state shaped like it),
    a copy: the whole tensor may be a view of a memory-mapped file."""
    if whole.dim() == 0:
        return whole.clone()  # Adam's step
    if name in ("chunk.wte.weight", "chunk.output_layer.weight"):
        whole = fit_vocab(whole, p.shape[0] * tp)
    piece = split_shard(whole, getattr(p, "partition_dim", None), tp, rank)
    if piece.shape != p.shape:
        raise ConfigError(
            f"{name}: the checkpoint's tensor of shape {tuple(whole.shape)} does not split into "
            f"tensor-parallel shards of shape {tuple(p.shape)}; was it saved for this model?"
        )
    return piece.clone()


def _optimizer_state(
    root: Path,
    shards: Shards,
    chunks: list[GPTChunk],
    optimizer: torch.optim.Optimizer,
    mine: dict[tuple[int, str], tuple[str, torch.Tensor]],
    config: Any,
    grid: Any,
) -> dict[str, Any]:
    """A state dict for ``optimizer`` (this rank's parameters) from the saved ones."""
    cfg = chunks[0].cfg
    saved = {rank: _states(root, rank, f) for rank, f in shards.items()}
    live = optimizer.state_dict()
    groups = next(iter(shards.values()))["optimizer"]["param_groups"]
    if len(groups) != len(live["param_groups"]):
        raise ConfigError(
            f"{root}: the saved optimizer has {len(groups)} param groups, this run's "
            f"{len(live['param_groups'])}; resume with --no-load-optim (fresh optimizer state)"
        )
    ids = [i for group in live["param_groups"] for i in group["params"]]
    names = dict(zip(ids, optimizer_params(chunks, optimizer), strict=True))
    keys = {k for states in saved.values() for state in states.values() for k in state}
    state: dict[int, dict[str, Any]] = {}
    for k in sorted(keys):

        def pick(rank: tuple[int, int], c: int, key: str, k: str = k) -> torch.Tensor | None:
            value = saved[rank].get((c, key), {}).get(k)
            return value if isinstance(value, torch.Tensor) else None

        whole = whole_tensors(shards, cfg, pick, wanted={name for name, _ in mine.values()})
        for i, (c, key) in names.items():
            name, p = mine[c, key]
            if name in whole:
                state.setdefault(i, {})[k] = _slice(whole[name], p, name, config.tp, grid.tp_rank)
    return {
        "state": state,
        "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": now["params"]}
            for group, now in zip(groups, live["param_groups"], strict=True)
        ],
    }


def _states(root: Path, rank: tuple[int, int], state: dict[str, Any]) -> States:
    """The optimizer state of each parameter of one file, by (chunk, parameter name)."""
    model, optim = state["model"], state["optimizer"]
    ids = [i for group in optim["param_groups"] for i in group["params"]]
    if "optimizer_params" in state:
        names = [(int(c), str(key)) for c, key in state["optimizer_params"]]
    else:
        # Saved before the names were: the Trainer's param groups, weight-decayed parameters
        # (two or more dims) then the rest, each in chunk order.
        names = [(c, k) for c, sd in enumerate(model) for k, v in sd.items() if v.dim() >= 2]
        names += [(c, k) for c, sd in enumerate(model) for k, v in sd.items() if v.dim() < 2]
    pairs = list(zip(ids, names, strict=False))
    if len(names) != len(ids) or not all(
        _shaped_like(optim["state"].get(i, {}), model, c, key) for i, (c, key) in pairs
    ):
        raise ConfigError(
            f"{root}: the optimizer state of tensor rank {rank[0]}, pipeline rank {rank[1]} "
            "cannot be matched to the model's parameters; resume with --no-load-optim (fresh "
            "optimizer state) or under the saved layout"
        )
    return {(c, key): optim["state"].get(i, {}) for i, (c, key) in pairs}


def _shaped_like(state: dict[str, Any], model: list[dict[str, Any]], c: int, key: str) -> bool:
    """Whether parameter ``key`` of chunk ``c`` exists and every state tensor but the scalar
    step has its shape: the check that the names map the states right."""
    if c >= len(model) or key not in model[c]:
        return False
    shape = model[c][key].shape
    return all(v.shape == shape for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
