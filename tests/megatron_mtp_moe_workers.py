"""Launched workers of test_megatron_mtp_moe_ckpt: Megatron-Core 0.16.1's MTP GPTModel over its
MoE layer spec (float64, CPU) on expert-parallel ranks, each strictly loading its own legacy
file or its slices of a torch_dist store, with megatron_mtp_ckpt_workers' figures
and the routers' expert biases it loaded."""

from __future__ import annotations

import os

import torch

import megatron_core_workers as mcw
import megatron_dist_workers as mdw
import megatron_mtp_ckpt_workers as mtw


def ep_run(directory: str, fmt: str, tokens: torch.Tensor, labels: torch.Tensor) -> dict:
    """On each launched rank (one expert-parallel rank each, tp1 pp1): Megatron-Core's model,
    its local experts (and the depths') loaded from the checkpoint in ``directory``
    (``fmt`` torch: its rank's file; torch_dist: its slices as Megatron-LM's loader asks);
    megatron_run's logits, main per-token loss and depth losses."""
    from megatron.core import dist_checkpointing, parallel_state

    from megart.training import checkpoint
    from megart.training.ckpt_files import rank_dir
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_checkpoint import read_rank
    from megart.training.megatron_dist import read_common

    ep, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    mcw.on_cpu_only()
    root = checkpoint.iteration_dir(directory, checkpoint.latest_iteration(directory))
    if fmt == "torch":
        state = read_rank(root / rank_dir(0, 0, 1, rank, ep) / checkpoint.FILE)
        model = mcw.megatron_model(config_from_args(vars(state["args"])), ep=ep)
        model.load_state_dict(state["model"], strict=True)
    else:
        model = mcw.megatron_model(config_from_args(vars(read_common(root)["args"])), ep=ep)
        metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(True)}
        wanted = {"model": model.sharded_state_dict(metadata=metadata)}
        loaded = dist_checkpointing.load(wanted, str(root), strict=mdw.STRICTNESS)
        model.load_state_dict(loaded["model"], strict=True)
    out = mtw.megatron_run(model, tokens, labels)
    # The routers' expert biases it loaded (its buffers), by state dict name.
    out["biases"] = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("bias")
                     and ".router." in k}  # fmt: skip
    torch.distributed.destroy_process_group()
    return out


def tp_run(directory: str, fmt: str, tokens: torch.Tensor, labels: torch.Tensor) -> dict:
    """On each launched tensor-parallel rank: Megatron-Core's model with sequence parallelism
    (its MoE layers train at tp > 1 only with it) loading its rank's legacy file or its slices
    of the store; megatron_run's figures, the logits gathered over the vocabulary shards."""
    from megatron.core import dist_checkpointing, parallel_state

    from megart.training import checkpoint
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_checkpoint import read_rank
    from megart.training.megatron_dist import read_common

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    mcw.on_cpu_only()
    root = checkpoint.iteration_dir(directory, checkpoint.latest_iteration(directory))
    if fmt == "torch":
        state = read_rank(root / f"mp_rank_{rank:02d}" / checkpoint.FILE)
        cfg = config_from_args(vars(state["args"]))
        model = mcw.megatron_model(cfg, tp, sequence_parallel=True)
        model.load_state_dict(state["model"], strict=True)
    else:
        cfg = config_from_args(vars(read_common(root)["args"]))
        model = mcw.megatron_model(cfg, tp, sequence_parallel=True)
        metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(True)}
        wanted = {"model": model.sharded_state_dict(metadata=metadata)}
        loaded = dist_checkpointing.load(wanted, str(root), strict=mdw.STRICTNESS)
        model.load_state_dict(loaded["model"], strict=True)
    out = mtw._gathered(mtw.megatron_run(model, tokens, labels))
    torch.distributed.destroy_process_group()
    return out
