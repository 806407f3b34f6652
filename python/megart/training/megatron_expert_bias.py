"""The routers' expert biases (--moe-router-enable-expert-bias) of Megatron-LM's own legacy
files, whole: each rank file holds its stage's routers' buffers under the chunk's local layer
numbers (megatron_file_read.file_expert_bias reads one file's), where megart's files keep every
layer's (models.moe_router.expert_bias_rows). A load under another layout, and the conversions,
need every stage's; and the conversions carry them between Megatron-Core's whole state dict
(``decoder.layers.N.mlp.router.expert_bias``) and megart's rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.config import GPTConfig
from megart.models.megatron_names import expert_bias_key, expert_bias_layer
from megart.training import megatron_file_read
from megart.training.ckpt_files import FILE, rank_dir, saved_expert_parallel
from megart.training.megatron_file_read import PARTIAL_BIAS
from megart.training.megatron_files import model_chunks, torch_load
from megart.training.shards import file_layer_ids


def gathered(root: Path, saved: dict[str, Any], cfg: GPTConfig) -> torch.Tensor | None:
    """Every layer's expert bias in the Megatron-LM legacy checkpoint ``root`` (an iteration
    directory, saved under layout ``saved``, a file's "config"): each pipeline rank's
    tensor-rank-0 file's rows (tensor and expert-parallel ranks hold the same routers),
    memory-mapped, only the biases' pages read."""
    pp, ep = saved["pipeline_model_parallel_size"], saved_expert_parallel({"config": saved})
    rows = None
    for p in range(pp):
        path = root / rank_dir(0, p, pp, 0, ep) / FILE
        if not path.is_file():
            raise ConfigError(f"{path} is missing: the checkpoint is incomplete")
        raw = torch_load(path, mmap=True)
        ids = file_layer_ids(raw, p, pp, cfg)
        part = megatron_file_read.file_expert_bias(model_chunks(raw), ids, cfg)
        rows = part if rows is None else rows + part  # each layer on one stage: others 0
    return rows


def of_shards(shards: dict[tuple[int, int], dict[str, Any]]) -> torch.Tensor | None:
    """Every layer's expert bias of read_shards' files: megart's record (in every file), or
    the sum of Megatron-LM's files' own layers' rows over the pipeline ranks (tensor rank 0)."""
    first = shards[0, 0]
    if first.get("expert_bias") is None or not first.get(PARTIAL_BIAS):
        return first.get("expert_bias")
    return torch.stack([s["expert_bias"] for (t, _), s in shards.items() if t == 0]).sum(0)


def popped(model: dict[str, torch.Tensor], cfg: GPTConfig) -> torch.Tensor | None:
    """Megatron-Core's whole state dict ``model`` without its routers' expert biases, which
    are returned as megart's rows ([layers, E] fp32, zero for dense layers; None without)."""
    n = cfg.num_layers
    found = {layer: key for key in model if (layer := expert_bias_layer(key, n)) is not None}
    if not found or cfg.num_experts is None:
        return None
    rows = torch.zeros(n + (cfg.mtp_num_layers or 0), cfg.num_experts)  # the depths' after
    for layer, key in found.items():
        rows[layer] = model.pop(key).float()
    return rows


def added(model: dict[str, torch.Tensor], rows: torch.Tensor, cfg: GPTConfig) -> None:
    """Each MoE layer's expert bias from megart's ``rows`` into Megatron-Core's whole state dict
    ``model``, in fp32 as Megatron-Core keeps the buffer."""
    for layer in range(cfg.num_layers + (cfg.mtp_num_layers or 0)):
        if cfg.is_moe_layer(layer):
            model[expert_bias_key(layer, cfg.num_layers)] = rows[layer].float().clone()
