"""GPU and cluster profiles: small JSON files (``profiles/*.json``) that a user copies, edits for
their own cluster and passes with ``megart plan --gpu-profile FILE``. Each file says where every
figure comes from (its ``sources``), and which two were fitted."""

from __future__ import annotations

import json
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
    if "gemm_half_gflop" in data:
        raise ConfigError(
            f"--gpu-profile {path}: gemm_half_gflop was replaced by gemm_half_dim (efficiency "
            "now follows a product's smallest dimension, not its FLOPs); refit it with "
            "bench/plan_tables.py --fit or copy the value from one of "
            f"{PROFILE_DIR}"
        )
    names = [f.name for f in fields(GPUProfile)]
    missing = [n for n in names if n not in data and n != "sources"]
    unknown = [k for k in data if k not in names]
    if missing or unknown:
        raise ConfigError(
            f"--gpu-profile {path}: "
            + "; ".join(
                x
                for x in (
                    f"missing {', '.join(missing)}" if missing else "",
                    f"unknown keys {', '.join(unknown)}" if unknown else "",
                )
                if x
            )
            + f" (copy one of {PROFILE_DIR} and edit it)"
        )
    data.setdefault("sources", {})
    for n in names:
        if n in ("name", "description", "sources"):
            continue
        v = data[n]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"--gpu-profile {path}: {n} must be a positive number, got {v!r}")
    if not isinstance(data["gpus_per_node"], int):
        raise ConfigError(f"--gpu-profile {path}: gpus_per_node must be an integer")
    return GPUProfile(**data)


def group_ranks_per_node(gpu: GPUProfile, tp: int, n: int) -> int:
    """How many of a group's ``n`` ranks one node holds, the members sitting ``tp`` apart (a
    data- or context-parallel group: megart train places ranks tp-cp-dp-pp): all while t x n
    GPUs fit in a node, else gpus_per_node / t (at least one)."""
    if tp * n <= gpu.gpus_per_node:
        return n
    return max(1, min(n, gpu.gpus_per_node // tp))
