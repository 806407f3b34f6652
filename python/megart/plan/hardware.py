"""GPU and cluster profiles: small JSON files (``profiles/*.json``) that a user copies, edits for
their own cluster and passes with ``megart plan --gpu-profile FILE``. Each file says where every
figure comes from (its ``sources``), and which two were fitted."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from megart.errors import ConfigError

PROFILE_DIR = Path(__file__).with_name("profiles")
GPUS = tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))
GIB = 1 << 30


@dataclass(frozen=True)
class GPUProfile:
    """One GPU of a cluster of 8-GPU (``gpus_per_node``) NVLink nodes with one network rail per
    GPU. Bandwidths are what a collective achieves (nccl-tests' busbw), not datasheet peaks."""

    name: str
    description: str
    peak_tflops: float  # dense bf16/fp16
    memory_gib: float
    memory_usable_fraction: float  # what the allocator can hand out (fragmentation)
    workspace_gib: float  # CUDA context, cuBLAS workspace, NCCL buffers
    hbm_gb_per_s: float
    gpus_per_node: int
    nvlink_bus_gb_per_s: float
    rail_gb_per_s: float
    link_latency_us: float
    # The fitted pair: a matrix product whose smallest dimension is m runs at
    # peak x gemm_efficiency_max x m / (m + gemm_half_dim), Hockney's n-1/2 form.
    gemm_efficiency_max: float
    gemm_half_dim: float
    sources: dict

    @property
    def usable_bytes(self) -> float:
        """Bytes a training process may fill before it runs out of memory."""
        return (self.memory_gib * self.memory_usable_fraction - self.workspace_gib) * GIB


def load_profile(gpu: str | None = None, path: str | None = None) -> GPUProfile:
    """The profile named ``gpu`` (one of GPUS) or read from the JSON file ``path``."""
    if (gpu is None) == (path is None):
        raise ConfigError("give --gpu NAME or --gpu-profile FILE (one of them)")
    if gpu is not None:
        if gpu not in GPUS:
            raise ConfigError(f"--gpu {gpu!r} is not a known profile; use one of {', '.join(GPUS)}")
        path = str(PROFILE_DIR / f"{gpu}.json")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--gpu-profile {path}: cannot read it as JSON ({e})") from e
    _check_profile(path, data)
    return GPUProfile(**{"sources": {}, **data})


def _check_profile(path: str, data: object) -> None:
    """Refuses, naming the key, a profile whose figures could not describe a GPU: a JSON
    value other than an object, keys missing or unknown, a figure that is not a finite positive
    number (NaN and Infinity are JSON to Python's reader), a usable fraction above 1, a
    workspace that leaves no memory to train in."""
    where = f"--gpu-profile {path}"
    copy = f"copy one of {PROFILE_DIR} and edit it"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a profile is one JSON object ({copy})")
    if "gemm_half_gflop" in data:
        raise ConfigError(
            f"{where}: gemm_half_gflop was replaced by gemm_half_dim (efficiency "
            "now follows a product's smallest dimension, not its FLOPs); refit it with "
            "bench/plan_tables.py --fit or copy the value from one of "
            f"{PROFILE_DIR}"
        )
    names = [f.name for f in fields(GPUProfile)]
    missing = [n for n in names if n not in data and n != "sources"]
    unknown = [k for k in data if k not in names]
    if missing or unknown:
        said = [f"missing {', '.join(missing)}"] if missing else []
        said += [f"unknown keys {', '.join(unknown)}"] if unknown else []
        raise ConfigError(f"{where}: {'; '.join(said)} ({copy})")
    for n in ("name", "description"):
        if not isinstance(data[n], str):
            raise ConfigError(f"{where}: {n} must be a string, got {data[n]!r}")
    if not isinstance(data.get("sources", {}), dict):
        raise ConfigError(f"{where}: sources must be an object (figure -> where it comes from)")
    for n in names:
        if n in ("name", "description", "sources"):
            continue
        v = data[n]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ConfigError(f"{where}: {n} must be a finite positive number, got {v!r}")
    if not isinstance(data["gpus_per_node"], int):
        raise ConfigError(f"{where}: gpus_per_node must be an integer")
    if data["memory_usable_fraction"] > 1:
        raise ConfigError(
            f"{where}: memory_usable_fraction {data['memory_usable_fraction']} is the share of "
            "memory_gib the allocator can hand out: give at most 1"
        )
    usable = data["memory_gib"] * data["memory_usable_fraction"]
    if data["workspace_gib"] >= usable:
        raise ConfigError(
            f"{where}: workspace_gib {data['workspace_gib']} leaves nothing of the "
            f"{usable:g} GiB usable (memory_gib x memory_usable_fraction) to train in: give "
            "a smaller workspace_gib"
        )


def group_ranks_per_node(gpu: GPUProfile, tp: int, n: int) -> int:
    """How many of a group's ``n`` ranks one node holds, the members sitting ``tp`` apart (a
    data- or context-parallel group: megart train places ranks tp-cp-dp-pp): all while t x n
    GPUs fit in a node, else gpus_per_node / t (at least one)."""
    if tp * n <= gpu.gpus_per_node:
        return n
    return max(1, min(n, gpu.gpus_per_node // tp))
