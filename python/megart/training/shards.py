"""A training checkpoint's model-parallel files merged into the whole model, and split again.

One merging path serves megart.training.export_hf (every file, in one process) and
megart.training.reshard (loading under another parallel layout: each rank reads the files its
own layers are in). Each file (``iter_N/mp_rank_TT[_PPP]/``, see megart.training.checkpoint)
holds its rank's model chunks, the layer ids of each chunk and the model's GPTConfig. A
parameter's tensor-parallel shards are concatenated along the dimension its module split it on
(its ``partition_dim``), and the chunks' layers are named by their place in the whole model
(``chunk.blocks.{layer}...``, as a one-chunk GPT names them; chunk c of pipeline rank r is
virtual stage c * p + r). Splitting is the inverse: t equal pieces along the same dimension.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models import GPTChunk, GPTConfig, chunk_layers
from megart.training import norm_biases
from megart.training.ckpt_files import (
    FILE,
    NORM_BIASES_ADDED,
    expert_rank_files,
    read_file,
    saved_expert_parallel,
)
from megart.training.expert_shards import merge_expert_files
from megart.training.megatron_files import is_megatron_file, megatron_layer_ids, model_chunks

Shards = dict[tuple[int, int], dict[str, Any]]  # (tensor rank, pipeline rank) -> its file
# pick((tensor rank, pipeline rank), chunk, name): the shard to merge, None where there is none
Pick = Callable[[tuple[int, int], int, str], torch.Tensor | None]


def merge_shards(shards: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """One parameter's whole tensor from its tensor-parallel shards, in rank order: split along
    ``dim`` (0 for column-parallel layers and the vocab-parallel embedding, 1 for row-parallel
    ones), or replicated when ``dim`` is None (every rank holds it all; rank 0's is taken)."""
    return shards[0] if dim is None else torch.cat(shards, dim)


def split_shard(whole: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s shard of ``whole`` among ``tp`` ranks, as the
    tensor-parallel layers take theirs (the inverse of merge_shards); a view."""
    return whole if dim is None else whole.chunk(tp, dim)[rank]


def whole_name(key: str, layers: Sequence[int]) -> str:
    """A chunk's parameter name as the one-chunk GPT names it: the chunk's j-th block is
    layer ``layers[j]`` of the model."""
    if key.startswith("blocks."):
        _, j, rest = key.split(".", 2)
        key = f"blocks.{layers[int(j)]}.{rest}"
    return "chunk." + key


def read_shards(root: Path, pp_ranks: Iterable[int] | None = None, announce: bool = True) -> Shards:
    """The model-parallel files of checkpoint ``root`` (all of them must be there), read
    memory-mapped: every file, or the tensor-parallel files of pipeline ranks ``pp_ranks``;
    an expert-parallel checkpoint's files of each rank merged (megart.training.expert_shards).
    ``announce``: print the note on LayerNorm biases an older megart left out, if it did
    (megart.training.norm_biases; a training load prints it once, from rank 0)."""
    found = sorted(root.glob(f"mp_rank_*/{FILE}"))
    if not found:
        raise ConfigError(f"{root} holds no mp_rank_*/{FILE}: it is not a megart checkpoint")
    layout = read_file(found[0])["config"]
    tp = layout["tensor_model_parallel_size"]
    pp = layout["pipeline_model_parallel_size"]
    ep = saved_expert_parallel({"config": layout})
    paths = expert_rank_files(root, tp, pp, ep)
    wanted = set(range(pp) if pp_ranks is None else pp_ranks)
    # An expert-parallel checkpoint's files of one (tensor, pipeline) rank merged into one.
    files = {
        (t, p): merge_expert_files(root, p, [read_file(paths[t, p, e]) for e in range(ep)])
        for t in range(tp)
        for p in range(pp)
        if p in wanted
    }
    added = [n for f in files.values() for n in f[NORM_BIASES_ADDED]]
    if added and announce:
        print(norm_biases.note(root, added), flush=True)
    return files


def layer_ids(state: dict[str, Any], pp_rank: int, pp: int, cfg: GPTConfig) -> list[list[int]]:
    """The layers of each model chunk of a file."""
    if "layer_ids" in state:
        return [list(ids) for ids in state["layer_ids"]]
    # Saved before checkpoints held them: the same assignment pipeline_chunks makes.
    chunks = len(state["model"])
    return [list(r) for r in chunk_layers(cfg.num_layers, pp_rank, pp, chunks)]


def file_layer_ids(raw: dict[str, Any], pp_rank: int, pp: int, cfg: GPTConfig) -> list[list[int]]:
    """The layers of each model chunk of a file as torch.load reads it: megart's format, or
    Megatron-LM's legacy one (megart's record in it, or, written by Megatron-LM, its args)."""
    if not is_megatron_file(raw):
        return layer_ids(raw, pp_rank, pp, cfg)
    if "megart" in raw:
        return [list(ids) for ids in raw["megart"]["layer_ids"]]
    return megatron_layer_ids(vars(raw["args"]), pp_rank, len(model_chunks(raw)))


@functools.cache
def partition_dims(
    cfg: GPTConfig, layers: tuple[int, ...], first: bool, last: bool
) -> dict[str, int | None]:
    """The dimension each parameter of the chunk of ``layers`` (the model's layer numbers) is
    split along across tensor parallelism, None for replicated ones: read from the
    ``partition_dim`` the tensor-parallel layers give their parameters (as the live export's
    gathers do), on a copy of the chunk shrunk to a few numbers, since only names and dims
    matter. The numbers, not just how many: which layers have experts (--moe-layer-freq)
    depends on them."""
    heads = cfg.num_attention_heads
    # Whole-head rope: a part of the shrunk heads of 2 could be no pair (rope has no weights).
    tiny = dataclasses.replace(
        cfg,
        vocab_size=1,
        seq_length=1,
        hidden_size=2 * heads,
        ffn_hidden_size=None,
        rotary_percent=1.0,
    )
    # Forked: torch.nn's default initialisation draws from torch's default generator, which a
    # resharding rank must leave as its run seeded it.
    with torch.random.fork_rng(devices=[]):
        probe = GPTChunk(tiny, layers, first, last)
    return {name: getattr(p, "partition_dim", None) for name, p in probe.named_parameters()}


def whole_tensors(
    shards: Shards,
    cfg: GPTConfig,
    pick: Pick | None = None,
    wanted: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The whole tensors of the one-chunk GPT's parameters (named by whole_name) that
    ``shards`` hold, or of those named in ``wanted``. ``pick`` gives the shards to merge: by
    default the weights; an optimizer state shaped like them, say, where a scalar one (Adam's
    step) is the same on every rank. Names a pick has no shard of are left out. The vocab
    embedding keeps the padding of the saved tensor-parallel size (see
    megart.models.vocab.fit_vocab)."""
    layout = next(iter(shards.values()))["config"]
    tp = layout["tensor_model_parallel_size"]
    pp = layout["pipeline_model_parallel_size"]
    if pick is None:

        def pick(rank: tuple[int, int], chunk: int, key: str) -> torch.Tensor | None:
            return shards[rank]["model"][chunk][key]

    whole: dict[str, torch.Tensor] = {}
    for p in sorted({p for _, p in shards}):
        files = [shards[t, p] for t in range(tp)]
        for c, layers in enumerate(layer_ids(files[0], p, pp, cfg)):
            first, last = layers[0] == 0, layers[-1] == cfg.num_layers - 1
            dims = partition_dims(cfg, tuple(layers), first, last)
            _check_names([f["model"][c] for f in files], dims, p, c)
            for key, dim in dims.items():
                name = whole_name(key, layers)
                if key == "wte.weight" and not first:
                    continue  # the last stage's copy of the tied embedding, kept equal in training
                if wanted is not None and name not in wanted:
                    continue
                parts = [pick((t, p), c, key) for t in range(tp)]
                if any(part is None for part in parts):
                    continue
                whole[name] = merge_shards(parts, dim if parts[0].dim() else None)
    return whole


def _check_names(
    states: list[dict[str, torch.Tensor]], dims: dict[str, int | None], pp_rank: int, chunk: int
) -> None:
    for t, state in enumerate(states):
        extra, lacking = sorted(set(state) - set(dims)), sorted(set(dims) - set(state))
        if extra or lacking:
            raise ConfigError(
                f"model chunk {chunk} of tensor rank {t}, pipeline rank {pp_rank} does not "
                f"match megart's GPT (unknown: {extra}; missing: {lacking}); was it written by "
                "another version of megart?"
            )
