"""Which layers each pipeline rank's model chunks hold, as megart train builds them, and how
many of them full recomputation replays: one place for the trainer (model_chunks), its FLOP
count and posting-plan costs, and megart plan."""

from __future__ import annotations

from typing import Any

from megart.models.config import GPTConfig
from megart.models.stages import chunk_layers
from megart.training.config import TrainConfig
from megart.training.flops import replayed_in_chunks, replayed_moe_in_chunks


def placement(config: TrainConfig) -> dict[str, Any]:
    """chunk_layers' (and pipeline_chunks') placement of the layers: pp ranks of v chunks each
    (zb-v's V, uneven first/last stages), as model_chunks builds them."""
    return {
        "pp": config.pp,
        "chunks": config.chunks,
        "v_shape": config.schedule == "zb-v",
        **config.stages,
    }


def rank_layers(config: TrainConfig, pp_rank: int) -> list[range]:
    """The layers of each model chunk of pipeline rank ``pp_rank``."""
    return chunk_layers(config.num_layers, pp_rank, **placement(config))


def every_rank_layers(config: TrainConfig) -> list[list[range]]:
    """The layers of each model chunk of each pipeline rank (rank r's list at index r)."""
    return [rank_layers(config, r) for r in range(config.pp)]


def replayed_layer_count(config: TrainConfig, model_config: GPTConfig) -> int:
    """The layers full recomputation replays over the whole model: every chunk of every
    pipeline rank, each as its chunk runs it (block: the first N of each chunk)."""
    return replayed_in_chunks(
        model_config, (len(c) for ranks in every_rank_layers(config) for c in ranks)
    )


def replayed_moe_layer_count(config: TrainConfig, model_config: GPTConfig) -> int:
    """Of replayed_layer_count's layers, the mixture-of-experts ones (their experts' products
    replayed: training.flops)."""
    return replayed_moe_in_chunks(
        model_config, (c for ranks in every_rank_layers(config) for c in ranks)
    )
