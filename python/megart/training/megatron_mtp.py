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
depths are; torch_dist keys it as a replica of the first stage's, as megart writes its own
last stage's copy). megart writes and reads the depths on one pipeline stage in both formats,
and on several in torch_dist with an untied output layer and without the distributed
optimizer; MoE depths (a depth takes the last decoder layer's kind) on one stage without the
distributed optimizer (their experts ``transformer_layer.mlp.experts.local_experts.E.`` split
over the expert-parallel ranks as a decoder layer's, their routers' ``expert_bias``); the rest
is refused by name (refuse_depths). Its sharded (torch_dist) keys are the
module names: each depth keyed apart (``mtp.layers.K.<name>``, no stacked layer dimension), its
layer's norms under the names Transformer Engine's fused layers have (the local spec's keys
map, as a decoder layer's), an MoE depth's experts under one key with the expert dimension
first (``mtp.layers.K.transformer_layer.mlp.experts.experts.linear_fc1.weight`` [E, ...]).
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
    untied = bool(a.get("untie_embeddings_and_output_weights"))
    fmt = a.get("ckpt_format") or "torch"
    refuse_depths(
        depths, a.get("num_experts"), pp, fmt, untied, bool(a.get("use_distributed_optimizer"))
    )
    return dict(
        mtp_num_layers=int(depths),
        mtp_loss_scaling_factor=float(a.get("mtp_loss_scaling_factor", 0.1)),
    )


def refuse_mtp_layout(
    cfg: GPTConfig, pp: int, fmt: str, distributed_optimizer: bool = False
) -> None:
    """Refuses writing or reading ``cfg``'s depths in Megatron-LM's format ``fmt`` (torch or
    torch_dist) on ``pp`` pipeline stages (virtual ones counted) where megart does not place
    them as Megatron-Core does (MoE depths: on one stage, without the distributed optimizer)."""
    untied = cfg.untie_embeddings_and_output_weights
    refuse_depths(cfg.mtp_num_layers, cfg.num_experts, pp, fmt, untied, distributed_optimizer)


def refuse_depths(
    depths: int | None,
    experts: int | None,
    pp: int,
    fmt: str,
    untied: bool,
    distributed_optimizer: bool = False,
) -> None:
    """refuse_mtp_layout's refusals of ``depths`` with ``experts`` on ``pp`` stages in ``fmt``,
    the output layer ``untied`` or not, with or without the distributed optimizer."""
    if not depths:
        return
    where = f"Megatron-LM's checkpoints (--ckpt-format {fmt})"
    head = f"a model with multi-token prediction (--mtp-num-layers {depths})"
    if experts and (pp > 1 or distributed_optimizer):
        # MoE depths are tested on one stage with Megatron-Core's plain optimizer (its
        # expert-parallel buckets of the depths under the distributed optimizer are untried).
        why = "on several pipeline stages" if pp > 1 else "with --use-distributed-optimizer"
        raise ConfigError(
            f"{head} and experts (--num-experts {experts}) {why}: megart writes and reads "
            f"MoE depths in {where} on one pipeline stage without the distributed optimizer; "
            "use --pipeline-model-parallel-size 1 and no --use-distributed-optimizer there, "
            "or megart's own checkpoint format (--ckpt-format megart)"
        )
    if pp == 1:
        return
    # Megatron-Core's last stage holds the depths and a copy of the word embedding, which
    # megart writes as torch_dist's replica of the first stage's; 0.16.1's own GPTModel cannot
    # key a tied output layer beside that copy (its tie asserts), and its distributed
    # optimizer over the copy is untried.
    why = {
        "torch": fmt == "torch",
        "tied embeddings (Megatron-Core 0.16.1 cannot key them there)": not untied,
        "--use-distributed-optimizer": distributed_optimizer,
    }
    unbuilt = [k for k, v in why.items() if v]
    if unbuilt:
        raise ConfigError(
            f"{head} on {pp} pipeline stages: megart writes and reads its depths in {where} "
            f"on one pipeline stage, or on several in torch_dist with "
            f"--untie-embeddings-and-output-weights and without the distributed optimizer "
            f"(here: {', '.join(unbuilt)}); use --pipeline-model-parallel-size 1 there, or "
            "megart's own checkpoint format (--ckpt-format megart)"
        )
