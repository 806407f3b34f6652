"""Megatron-Core's dist_checkpointing (torch_dist) next to megart's: Megatron-Core's GPTModel
loads what megart writes and writes what megart reads. Run in launched processes (Megatron-Core
keeps its parallel state in module globals)."""

from __future__ import annotations

import multiprocessing
import os
import zlib
from pathlib import Path

import torch

from megart.models import GPT, GPTConfig
from megart.models.vocab import fit_vocab
from megatron_core_workers import megatron_logits, megatron_model, on_cpu_only

# Megatron-LM's default --dist-ckpt-strictness: a key asked for that the checkpoint lacks fails.
STRICTNESS = "assume_ok_unexpected"


def _no_cuda() -> None:
    # Its writer waits for CUDA copies (none here) and counts memory with psutil.
    torch.cuda.synchronize = lambda *a, **kw: None


def _parallel(tp: int, pp: int) -> None:
    """Megatron-Core's model parallelism over the launched ranks (gloo), kept on the CPU
    (megatron_core_workers.on_cpu_only: an MoE router's gate too)."""
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, pp)
    on_cpu_only()


def stage_logits(model: torch.nn.Module, tokens: torch.Tensor, tp: int, pp: int) -> torch.Tensor:
    """The logits of a tp x pp Megatron-Core model on this rank's stage, the pipeline run by
    hand (hidden states passed between stages), gathered over the vocabulary shards on every
    rank of the last stage; None elsewhere."""
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    stage = ps.get_pipeline_model_parallel_rank()
    if stage > 0:
        shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)
        hidden = torch.empty(shape, dtype=torch.double)
        torch.distributed.recv(hidden, group=pp_group, group_src=stage - 1)
        model.set_input_tensor(hidden)
    out = megatron_logits(model, tokens)  # a stage before the last: its hidden states
    if stage < pp - 1:
        torch.distributed.send(out.contiguous(), group=pp_group, group_dst=stage + 1)
        return None
    parts = [torch.empty_like(out) for _ in range(tp)]
    torch.distributed.all_gather(
        parts, out.contiguous(), group=ps.get_tensor_model_parallel_group()
    )
    return torch.cat(parts, -1)


def load_and_run(dist_dir: str, tokens: torch.Tensor, tp: int, pp: int) -> torch.Tensor | None:
    """On each launched rank (tp x pp of them): Megatron-Core's GPTModel of the checkpoint's
    args, loading its own slices of the torch_dist checkpoint in ``dist_dir`` through
    dist_checkpointing.load as Megatron-LM's loader calls it, then strictly into the model;
    the logits of ``tokens`` (last stage)."""
    from megatron.core import dist_checkpointing

    from megart.training.checkpoint import iteration_dir, latest_iteration
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_dist import read_common

    _no_cuda()
    _parallel(tp, pp)
    root = iteration_dir(dist_dir, latest_iteration(dist_dir))
    cfg = config_from_args(vars(read_common(root)["args"]))
    model = megatron_model(cfg, tp, pp)
    # Megatron-LM's generate_state_dict nests the model's under "model" (common.pt's keys
    # are merged into the result beside it).
    wanted = {"model": model.sharded_state_dict()}
    loaded = dist_checkpointing.load(wanted, str(root), strict=STRICTNESS)
    model.load_state_dict(loaded["model"], strict=True)
    # Evaluation mode: its MoE layers refuse to train at tp > 1 without sequence parallelism.
    logits = stage_logits(model.eval(), tokens, tp, pp)
    torch.distributed.destroy_process_group()
    return logits


def save_megatron(kw: dict, out_dir: str, tp: int, pp: int, tokens: torch.Tensor) -> dict:
    """On each launched rank: Megatron-Core's GPTModel of ``GPTConfig(**kw)`` at its own initial
    weights (tp x pp ranks), saved by dist_checkpointing.save into ``out_dir`` as Megatron-LM's
    saver does (common state: args, checkpoint_version, iteration); its logits of ``tokens``."""
    from megatron.core import dist_checkpointing

    from megart.training.checkpoint import iteration_dir
    from megart.training.megatron_args import megatron_args

    _no_cuda()
    _parallel(tp, pp)
    cfg = GPTConfig(**kw)
    torch.manual_seed(7)
    model = megatron_model(cfg, tp, pp)
    tied = not cfg.untie_embeddings_and_output_weights
    with torch.no_grad():  # no zero biases, no unit norms: every tensor tells
        for name, p in model.named_parameters():
            # Drawn by name: a tensor replicated over ranks (norms, the last stage's copy of
            # the tied embedding) stays equal on all of them.
            if tied and name == "output_layer.weight":
                name = "embedding.word_embeddings.weight"
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.add_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 0.1)
    args = megatron_args(cfg, 3, tp, pp)
    args.ckpt_format = "torch_dist"
    root = iteration_dir(out_dir, 3)
    if torch.distributed.get_rank() == 0:
        root.mkdir(parents=True)
    torch.distributed.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 3,
             "model": model.sharded_state_dict()}  # fmt: skip
    # Megatron-Core's writer hands the bytes to helper processes; Megatron-LM's ranks
    # (torchrun's) may have children, the launcher's daemon ranks may not: let this one.
    multiprocessing.current_process()._config["daemon"] = False
    dist_checkpointing.save(state, str(root))
    if torch.distributed.get_rank() == 0:
        (Path(out_dir) / "latest_checkpointed_iteration.txt").write_text("3\n")
    logits = stage_logits(model.eval(), tokens, tp, pp)  # eval: as load_and_run's
    torch.distributed.destroy_process_group()
    return {"logits": logits, "rank": int(os.environ["RANK"])}


def megart_logits(cfg: GPTConfig, megatron_state: dict, tokens: torch.Tensor) -> torch.Tensor:
    """megart's GPT (float64) holding Megatron-Core's whole state dict (any vocab padding)."""
    from megart.models.megatron_names import from_megatron

    ours = GPT(cfg).double()
    state = from_megatron(megatron_state, cfg)
    for name in ("wte.weight", "output_layer.weight"):
        if name in state:
            state[name] = fit_vocab(state[name], cfg.padded_vocab_size(1))
    ours.chunk.load_state_dict({k: v.double() for k, v in state.items()}, strict=True)
    with torch.no_grad():
        return ours(tokens)
