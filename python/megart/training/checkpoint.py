"""Checkpoints in Megatron-LM's layout, with everything resume needs: the format, and ``load``
(resuming from the last complete one). Writing them (``save``, atomic, and ``write_release``)
is megart.training.checkpoint_save's; both stay importable from here.

    <dir>/latest_checkpointed_iteration.txt          the last complete checkpoint
    <dir>/iter_0000100/mp_rank_00/model_optim_rng.pt         (pipeline size 1)
    <dir>/iter_0000100/mp_rank_00_001/model_optim_rng.pt     (tensor rank 0, pipeline rank 1)

One file per model-parallel rank, written by data-parallel rank 0 of it (data-parallel ranks
hold the same weights, optimizer state and random states). Each holds this rank's model chunks,
the optimizer state, the random streams, the fp16 loss scale, the iteration and the samples
consumed, so a resumed run continues the same loss curve: the data is a function of the
iteration, the learning rate and --rampup-batch-size's batch of the consumed samples. It
also holds the model's whole GPTConfig, each chunk's layer ids and the parameter each
optimizer state belongs to, so that the files can be merged into one model without the
training flags (megart.training.shards): megart.training.export_hf writes it out, and ``load``
reshards a checkpoint of another tensor/pipeline/expert-parallel layout (megart.training.
reshard), whatever places the layers (zb-v's V too: the files say which layers each chunk
holds). Checkpoints from before those were saved hold a GPT-2-architecture model (the Trainer
built no other) and the Trainer's optimizer order.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

import megart.distributed as dist
from megart.errors import ConfigError
from megart.models import GPTConfig
from megart.models.config import architecture_flags
from megart.models.config_flags import differing
from megart.models.moe_router import load_expert_bias
from megart.tensor_parallel.random import GeneratorStates
from megart.training import (
    megatron_dist,
    megatron_dist_train_load,
    megatron_expert_bias,
    norm_biases,
    reshard,
)
from megart.training.checkpoint_save import save, write_release  # re-exported: the public API
from megart.training.ckpt_files import (  # re-exported: checkpoint.FILE etc. as before
    FILE,
    MODEL_FIELDS,
    NORM_BIASES_ADDED,
    PARALLEL_FIELDS,
    TRACKER,
    chosen_iteration,
    in_live_order,
    iteration_dir,
    latest_iteration,
    optimizer_params,
    rank_dir,
    read_file,
    required_latest_iteration,
)
from megart.training.host_random import install_host_generators
from megart.training.megatron_args import args_record
from megart.training.megatron_file_read import PARTIAL_BIAS
from megart.training.megatron_scheduler import check_scheduler

__all__ = [
    "FILE",
    "MODEL_FIELDS",
    "PARALLEL_FIELDS",
    "TRACKER",
    "chosen_iteration",
    "iteration_dir",
    "latest_iteration",
    "load",
    "model_config",
    "optimizer_params",
    "rank_dir",
    "read_file",
    "required_latest_iteration",
    "save",
    "write_release",
]


def load(
    directory: str | os.PathLike,
    config: Any,
    grid: Any,
    chunks: list[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    rng: Any,
    scaler: Any = None,
) -> tuple[int, int]:
    """Restores the last complete checkpoint in ``directory`` into the model chunks, the
    optimizer (and fp16 loss scaler) and the random streams; returns the iteration to continue
    from and the samples consumed by then (iterations x --global-batch-size for checkpoints
    saved before they were recorded, as Megatron assumes). ``config.no_load_optim`` and
    ``config.no_load_rng`` skip those parts; with ``config.finetune`` only the weights are
    loaded and the run starts at iteration 0, as Megatron's flags. A checkpoint of another
    tensor/pipeline/expert-parallel layout is resharded (see megart.training.reshard; experts
    by their global index), keeping this run's own random streams; a directory without a
    checkpoint, or a checkpoint of another model, is a ConfigError naming the flags."""
    otherwise = ", or leave --load out to start from scratch"
    iteration = chosen_iteration(directory, config.ckpt_step, "--ckpt-step", otherwise)
    root = iteration_dir(directory, iteration)
    # Without expert parallelism the grid may be any object with the other coordinates.
    ep, ep_rank = getattr(grid, "ep", 1), getattr(grid, "ep_rank", 0)
    if megatron_dist.is_dist_checkpoint(root):
        return _load_dist(directory, root, config, grid, chunks, optimizer, rng, scaler)
    own = root / rank_dir(grid.tp_rank, grid.pp_rank, config.pp, ep_rank, ep) / FILE
    found = sorted(root.glob(f"mp_rank_*/{FILE}"))
    if not found:
        raise ConfigError(f"--load {directory}: {root} holds no mp_rank_*/{FILE}")
    # Any file tells the layout, the iteration and the loss scale (the same in every file).
    state = read_file(own if own.exists() else found[0])
    _check_model(directory, state, config, chunks[0].cfg)
    if state[NORM_BIASES_ADDED] and dist.get_rank() == 0:
        print(norm_biases.note(directory, state[NORM_BIASES_ADDED]), flush=True)
    # A release checkpoint (megart import-hf) holds weights only and is loaded as --finetune.
    finetune = config.finetune or bool(state.get("release"))
    load_optim = not (finetune or config.no_load_optim)
    load_rng = not (finetune or config.no_load_rng)
    _check_saved_parts(directory, state, load_optim, load_rng)
    if load_optim and state.get("opt_param_scheduler") is not None:  # written by Megatron-LM
        check_scheduler(state["opt_param_scheduler"], config, directory)
    resharded = reshard.needed(state, config, chunks)
    if resharded:
        reshard.restore(
            root, state["config"], config, grid, chunks, optimizer if load_optim else None
        )
        if dist.get_rank() == 0:
            held = reshard.saved_layers(root, state["config"], chunks[0].cfg)
            counts = [len(held[p]) for p in sorted(held)]
            line = reshard.describe(directory, iteration, state["config"], config, counts)
            print(line, flush=True)
    else:
        if not own.exists():
            raise ConfigError(f"--load {directory}: {own} is missing")
        for chunk, sd in zip(chunks, state["model"], strict=True):
            chunk.load_state_dict(sd)
        if load_optim:
            saved = state["optimizer"]
            params = state["optimizer_params"]
            optimizer.load_state_dict(in_live_order(saved, params, chunks, optimizer, directory))
        if load_rng and state["rng"] is not None:
            r = state["rng"]
            GeneratorStates(r["torch"], r["cuda"]).install()
            install_host_generators(r.get("python"), r.get("numpy"))
            if r["tracker"] is not None:  # None: Megatron-LM's (CUDA) streams, not taken
                rng.set_states(r["tracker"])
    if load_optim and scaler is not None and state.get("loss_scaler") is not None:
        scaler.load_state_dict(state["loss_scaler"])
    bias = state.get("expert_bias")
    if bias is not None and resharded and state.get(PARTIAL_BIAS):
        # Megatron-LM's own files: each holds its stage's routers; this rank's layers may
        # lie in any stage's file.
        bias = megatron_expert_bias.gathered(root, state["config"], chunks[0].cfg)
    if bias is not None:  # the routers' state beside their weights
        load_expert_bias(chunks, bias)
    if finetune:
        return 0, 0
    return _resume_point(int(state["iteration"]), state.get("consumed_train_samples"), config)


def _check_saved_parts(directory: Any, state: dict, load_optim: bool, load_rng: bool) -> None:
    """A checkpoint saved without its optimizer state or random streams (--no-save-optim,
    --no-save-rng) resumes only when told not to load them, as in Megatron-LM."""
    missing = [
        (what, flag)
        for what, flag, wanted, key in (
            ("optimizer state", "--no-load-optim", load_optim, "optimizer"),
            ("random streams", "--no-load-rng", load_rng, "rng"),
        )
        if wanted and state.get(key) is None
    ]
    if missing:
        raise ConfigError(
            f"--load {directory}: the checkpoint holds no {' and no '.join(w for w, _ in missing)} "
            f"(saved with --no-save-optim or --no-save-rng); resume with "
            f"{' '.join(f for _, f in missing)} (fresh ones, at the saved iteration) or with "
            "--finetune (weights only, from iteration 0)"
        )


def _load_dist(
    directory: Any,
    root: Path,
    config: Any,
    grid: Any,
    chunks: list[torch.nn.Module],
    optimizer: Any,
    rng: Any,
    scaler: Any,
) -> tuple[int, int]:
    """--load of a torch_dist store (Megatron-LM's, or megart train's --ckpt-format
    torch_dist) into any layout, zb-v's included (the store holds whole tensors by layer):
    see megart.training.megatron_dist_train_load.load. One of weights alone (convert-checkpoint's)
    loads as --finetune, like a release checkpoint."""
    common = megatron_dist.read_common(root)
    a = vars(common["args"])
    state = args_record(a)
    extra = common.get("megart")
    if isinstance(extra, dict) and extra.get("model_config") is not None:
        state["model_config"] = extra["model_config"]  # megart's own: every field
    _check_model(directory, state, config, chunks[0].cfg)
    finetune = config.finetune or not megatron_dist.has_optimizer_state(root)
    load_optim = not (finetune or config.no_load_optim)
    load_rng = not (finetune or config.no_load_rng)
    left_out = megatron_dist_train_load.load(
        root, common, config, grid, chunks, optimizer, rng, scaler, load_optim, load_rng, directory
    )
    if dist.get_rank() == 0:
        what = "the weights" + (", the optimizer" if load_optim else "")
        print(
            f"loaded {what} of {root} (torch_dist) into tensor-parallel {config.tp}, "
            f"pipeline-parallel {config.pp}{left_out}",
            flush=True,
        )
    if finetune:
        return 0, 0
    return _resume_point(int(common["iteration"]), a.get("consumed_train_samples"), config)


def _resume_point(iteration: int, consumed: Any, config: Any) -> tuple[int, int]:
    """The iteration to go on from and the samples consumed by then (iterations x
    --global-batch-size where the checkpoint did not record them, as Megatron assumes)."""
    return iteration, iteration * config.global_batch_size if consumed is None else int(consumed)


def model_config(state: dict[str, Any]) -> GPTConfig:
    """The GPTConfig of the model a checkpoint file belongs to."""
    saved = state.get("model_config")
    if saved is None:
        # Saved before checkpoints held the model's config: the Trainer then built GPT-2's
        # architecture with GPTConfig's defaults and these sizes, and nothing else.
        layout = state["config"]
        sizes = ("vocab_size", "seq_length", "hidden_size", "num_layers", "num_attention_heads")
        return GPTConfig(**{k: layout[k] for k in sizes})
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    fields = {k: v for k, v in saved.items() if k in known}
    # Saved before the config recorded the rotation: megart then rotated adjacent pairs.
    fields.setdefault("rotary_interleaved", True)
    return GPTConfig(**fields)


def _check_model(directory: Any, state: dict[str, Any], config: Any, cfg: Any) -> None:
    """Refuses a checkpoint of another model, naming each flag (or GPTConfig field) that
    differs: its weights cannot be resharded into this one."""
    saved = state["config"]
    # Rotary positions have no table, so their weights train at any sequence length (as
    # Megatron-LM's --load takes another --seq-length); learned positions are a row each.
    free = ("seq_length",) if cfg.position_embedding == "rotary" else ()
    differ = [
        f"--{f.replace('_', '-')} {saved[f]} (now {getattr(config, f)})"
        for f in MODEL_FIELDS
        if saved[f] != getattr(config, f)
        and not (f == "vocab_size" and saved[f] is None)
        and f not in free
    ]
    if saved["vocab_size"] is None:  # Megatron-LM's, its tokenizer's size unrecorded
        t = saved["tensor_model_parallel_size"]
        if saved["padded_vocab_size"] != cfg.padded_vocab_size(t):
            differ.append(
                f"a vocabulary padded to {saved['padded_vocab_size']} rows for "
                f"tensor-parallel {t} (--vocab-size {config.vocab_size} pads to "
                f"{cfg.padded_vocab_size(t)} with --make-vocab-size-divisible-by "
                f"{cfg.make_vocab_size_divisible_by})"
            )
    # The architecture flags that shape the weights or what they mean, beyond MODEL_FIELDS;
    # the rest (dropout, seed, --init-method-std, fused kernels, recomputation) may change.
    was, now = architecture_flags(model_config(state)), architecture_flags(cfg)
    differ += [f"{was[f]} (now {now[f]})" for f in differing(was, now)]
    # The routers' expert biases are training state held beside the weights (Megatron-Core's
    # persistent buffers, which its strict load requires): a run without them would drop them.
    # The other way round, the biases start from zero, as in a new run.
    if model_config(state).moe_router_enable_expert_bias and not cfg.moe_router_enable_expert_bias:
        differ.append("--moe-router-enable-expert-bias (now without it: its biases would be lost)")
    if differ:
        raise ConfigError(
            f"--load {directory}: the checkpoint was saved with " + ", ".join(differ) + "; "
            "a checkpoint of another model cannot be resharded (only the tensor- and "
            "pipeline-parallel layout may change), so resume with the saved values"
        )
