"""A torch.distributed.checkpoint (DCP) store written by several processes without a torch
process group: each rank writes its own slices, rank 0 merges what they wrote into the one
``.metadata`` DCP's and Megatron-Core's loaders read.

DCP's collective save gathers every rank's plan to a coordinator, which writes the global
metadata. megart's ranks have no torch.distributed group (their communicator is megart's own),
so each rank runs DCP's save alone over its slices (``_Slices``: DCP's protocol for a tensor
held in pieces of a larger one) into files named by its rank (``__R_0.distcp``) with its part
of the metadata (``__R.metadata``), which is what DCP itself writes with
``use_collectives=False``; after a barrier, rank 0 merges the parts (``merge``). The ranks share
the checkpoint's directory anyway: megart's saves are renamed into place by rank 0 once every
rank has written.

Merging checks that every tensor's chunks tile it exactly (no gap, no overlap), so a rank that
wrote a slice at a wrong offset, or did not write at all, fails the save instead of leaving a
store that loads garbage. ``check_covered`` makes the same check on reading.
"""

from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megart.errors import ConfigError

GLOBAL = ".metadata"


def _part(root: Path, rank: int) -> Path:
    return root / f"__{rank}{GLOBAL}"  # the name DCP gives a rank's own metadata


def written_ranks(root: Path) -> list[int]:
    """The ranks whose metadata parts are in ``root``, in order."""
    return sorted(int(p.name[2 : -len(GLOBAL)]) for p in root.glob(f"__*{GLOBAL}"))


class Pieces:
    """This rank's pieces of one stored tensor: DCP's load protocol for a tensor held in pieces
    (its global size, the chunk each piece covers, the piece of a chunk). For a load, the
    pieces are views of this rank's parameters, filled in place."""

    def __init__(self, size: torch.Size) -> None:
        self._size = torch.Size(size)
        self.pieces: dict[torch.Size, torch.Tensor] = {}

    def size(self) -> torch.Size:
        return self._size

    def add(self, offsets: list[int], piece: torch.Tensor) -> None:
        self.pieces[torch.Size(offsets)] = piece

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[torch.Size(index.offset)]


class PiecesPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, taking Pieces where it takes tensors: its first step would
    make them None (as any value not a tensor), its lookup would refuse them."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class Slices(Pieces):
    """The pieces of one global tensor that this rank writes, each a copy of its own (DCP would
    save a view's whole storage); DCP's save asks it for write items and, per item, the data."""

    def add(self, offsets: list[int], piece: torch.Tensor) -> None:
        if len(offsets) != len(self.size()) or piece.dim() != len(self.size()):
            raise ValueError(f"a piece of rank {piece.dim()} at {offsets} in {tuple(self.size())}")
        super().add(offsets, piece.detach().clone().contiguous())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, o),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=o, sizes=t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.size(),
                ),
            )
            for o, t in self.pieces.items()
        ]


class _SlicesPlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner, looking Slices' pieces up by offset (its own lookup takes
    only tensors and sharded tensors there)."""

    def __init__(self) -> None:
        # Not flattened: each object (a list) is one value, as Megatron-Core's planner stores it.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Slices):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class _RankWriter(dcp.FileSystemWriter):
    """DCP's file writer as one rank of a job without collectives: its files and its metadata
    named by ``rank``."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path, overwrite=True)
        self._rank = rank

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, rank=self._rank, use_collectives=False)


def write_rank(root: Path, rank: int, state: dict[str, Any]) -> None:
    """Writes this rank's part of the store in ``root``: ``state`` maps keys to Slices (its
    pieces of sharded tensors) or to objects (torch.save'd whole)."""
    with warnings.catch_warnings():
        # Another rank's metadata part already there is not "an existing checkpoint".
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        # Each rank saves alone by design (no torch.distributed group: megart's own).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            state, storage_writer=_RankWriter(root, rank), planner=_SlicesPlanner(), no_dist=True
        )


def _volume(sizes: Any) -> int:
    return math.prod(sizes)


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> int:
    """The number of elements two chunks share."""
    total = 1
    for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True):
        total *= max(0, min(oa + sa, ob + sb) - max(oa, ob))
    return total


def _check_tiling(key: str, meta: TensorStorageMetadata, where: Any) -> None:
    chunks = meta.chunks
    for c in chunks:
        if any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, meta.size, strict=True)):
            raise ConfigError(f"{where}: {key}'s chunk at {list(c.offsets)} lies outside it")
    # Sorted by offset, a chunk can overlap only chunks starting before its end on dim 0.
    ordered = sorted(chunks, key=lambda c: tuple(c.offsets))
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if _overlap(a, b):
                raise ConfigError(
                    f"{where}: {key}'s chunks at {list(a.offsets)} and {list(b.offsets)} overlap"
                )
    if sum(_volume(c.sizes) for c in chunks) != _volume(meta.size):
        raise ConfigError(f"{where}: {key}'s chunks do not cover all of {list(meta.size)}")


def merge(root: Path, ranks: list[int]) -> Metadata:
    """Merges the metadata parts ``ranks`` wrote in ``root`` into the store's ``.metadata``
    (and removes the parts); refuses a store whose tensors are not tiled exactly."""
    merged: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Any] = {}
    first: Metadata | None = None
    for rank in ranks:
        with open(_part(root, rank), "rb") as f:
            part: Metadata = pickle.load(f)
        first = first or part
        storage.update(part.storage_data or {})
        planner.update(part.planner_data or {})
        for key, meta in part.state_dict_metadata.items():
            was = merged.get(key)
            if was is None:
                merged[key] = meta
            elif isinstance(meta, TensorStorageMetadata) and isinstance(was, TensorStorageMetadata):
                if (was.size, was.properties.dtype) != (meta.size, meta.properties.dtype):
                    raise ConfigError(f"{root}: ranks wrote {key} with other sizes or types")
                was.chunks.extend(meta.chunks)
            elif not isinstance(meta, BytesStorageMetadata) or not isinstance(
                was, BytesStorageMetadata
            ):
                raise ConfigError(f"{root}: ranks wrote {key} as a tensor and as an object")
            else:  # an object written twice: only one rank may own it
                raise ConfigError(f"{root}: more than one rank wrote the object {key}")
    for key, meta in merged.items():
        if isinstance(meta, TensorStorageMetadata):
            _check_tiling(key, meta, root)
    assert first is not None
    out = Metadata(
        state_dict_metadata=merged,
        planner_data=planner,
        storage_data=storage,
        storage_meta=first.storage_meta,
        version=first.version,
    )
    tmp = root / (GLOBAL + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(out, f)
    tmp.replace(root / GLOBAL)
    for rank in ranks:
        _part(root, rank).unlink()
    return out


def check_covered(
    key: str, meta: TensorStorageMetadata, offsets: list[int], sizes: Any, where: Any
) -> None:
    """Refuses to read the region ``offsets``/``sizes`` of ``key`` unless the stored chunks
    cover it exactly (DCP would leave an uncovered part as it was)."""
    want = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    parts = [c for c in meta.chunks if _overlap(c, want)]
    covered = sum(_overlap(c, want) for c in parts)
    doubled = any(_overlap(a, b) for i, a in enumerate(parts) for b in parts[i + 1 :])
    if covered != _volume(sizes) or doubled:
        raise ConfigError(
            f"{where}: the store's {key} does not hold {list(sizes)} at {list(offsets)} exactly "
            "once (an incomplete or damaged checkpoint); load an earlier iteration or another "
            "checkpoint"
        )
