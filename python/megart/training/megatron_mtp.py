"""Multi-token prediction (megart.models.mtp) in Megatron-LM's checkpoints: its flags in the
``args`` record both ways, and which models megart writes and reads its depths for.

Megatron-LM's argparse names and defaults (its arguments.py, TransformerConfig 0.16):
``mtp_num_layers`` (None: no depths) and ``mtp_loss_scaling_factor`` (0.1). Its
load_args_from_checkpoint forces ``mtp_num_layers`` (megart.training.checkpoint_args does too)
and leaves the factor, a training setting, to the command line.

Megatron-Core 0.16.1's GPTModel with an MTP block spec (the local one, what megart's depths
compute) keeps the depths under ``mtp.layers.K.`` (``enorm``, ``hnorm``, ``eh_proj``,
``transformer_layer.<a decoder layer's names>``, ``final_layernorm``, registered in that
order, after the decoder and before the output layer), ``eh_proj`` a ColumnParallelLinear
2h -> h (its weight [h, 2h] split on its rows like linear_qkv's, with an ``_extra_state``), the
norms replicated. Without a custom pipeline layout every depth is on the last pipeline stage,
which then holds a copy of the word embedding too (GPTModel builds its embedding wherever the
depths are); megart writes and reads the depths on one pipeline stage, and refuses more by
name. Its sharded (torch_dist) keys are the module names: each depth keyed apart
(``mtp.layers.K.<name>``, no stacked layer dimension), its layer's norms under the names
Transformer Engine's fused layers have (the local spec's keys map, as a decoder layer's).
"""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError
from megart.models.config import GPTConfig

# Megatron-LM's MTP flags whose depths megart does not build (their args names): refused
# where a checkpoint's args set them (the command line's are megatron_refusal_families').
MTP_UNBUILT = (
    "mtp_standalone",
    "mtp_use_repeated_layer",
    "mtp_detach_heads",
    "mtp_hsm",
    "mtp_hybrid_override_pattern",
)
MTP_PREFIX = "mtp.layers."


def mtp_args(cfg: GPTConfig) -> dict[str, Any]:
    """The MTP flags of ``cfg`` as Megatron-LM's args hold them (None: no depths)."""
    return dict(
        mtp_num_layers=cfg.mtp_num_layers or None,
        mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
    )


def mtp_fields(a: dict[str, Any], where: str = "a Megatron-LM checkpoint") -> dict[str, Any]:
    """GPTConfig's MTP fields from Megatron-LM's args (``vars``): none where they hold no
    depths (older args lack the flags). Refuses the MTP variants megart does not build."""
    depths = a.get("mtp_num_layers") or None
    if depths is None:
        return {}
    unbuilt = [f"--{n.replace('_', '-')}" for n in MTP_UNBUILT if a.get(n)]
    if unbuilt:
        raise ConfigError(
            f"{where} with multi-token prediction and {', '.join(unbuilt)}: megart's depths "
            "each have a layer of their own on the last stage (no repeated layer, detached "
            "heads, hidden-state mixing, standalone stage or hybrid pattern)"
        )
    pp = (a.get("pipeline_model_parallel_size") or 1) * (
        a.get("virtual_pipeline_model_parallel_size") or 1
    )
    refuse_depths(depths, a.get("num_experts"), pp, "Megatron-LM's checkpoints")
    return dict(
        mtp_num_layers=int(depths),
        mtp_loss_scaling_factor=float(a.get("mtp_loss_scaling_factor", 0.1)),
    )


def refuse_mtp_layout(cfg: GPTConfig, pp: int, where: str) -> None:
    """Refuses writing or reading ``cfg``'s depths in ``where`` (a Megatron-LM format) on
    ``pp`` pipeline stages (virtual ones counted) where megart does not place them as
    Megatron-Core does, or with experts."""
    refuse_depths(cfg.mtp_num_layers, cfg.num_experts, pp, where)


def refuse_depths(depths: int | None, experts: int | None, pp: int, where: str) -> None:
    """refuse_mtp_layout's refusals of ``depths`` with ``experts`` on ``pp`` stages."""
    if not depths:
        return
    if pp > 1:
        raise ConfigError(
            f"a model with multi-token prediction (--mtp-num-layers {depths}) on "
            f"{pp} pipeline stages: megart writes and reads its depths in {where} on one "
            "pipeline stage only (Megatron-Core's last stage then holds the depths and a copy "
            "of the word embedding); use --pipeline-model-parallel-size 1 there, or megart's "
            "own checkpoint format (--ckpt-format megart)"
        )
    if experts:
        raise ConfigError(
            f"a model with multi-token prediction (--mtp-num-layers {depths}) and "
            f"experts (--num-experts {experts}): megart does not write or read its "
            f"depths in {where} with experts; keep it in megart's own checkpoint format "
            "(--ckpt-format megart)"
        )
