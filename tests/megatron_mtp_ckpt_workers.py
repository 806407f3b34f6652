"""Launched workers of test_megatron_mtp_ckpt: Megatron-Core 0.16.1's GPTModel with multi-token
prediction (local spec, float64, megatron_core_workers) loading Megatron-LM's checkpoints, and
megart's GPT holding the same weights: the logits, the main per-token loss and each depth's
loss of both."""

from __future__ import annotations

import os

import torch

import megatron_core_workers as mcw
import megatron_dist_workers as mdw
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import from_megatron


def megatron_run(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> dict:
    """Megatron-Core's (training mode, no dropout) main per-token loss [b, s] of ``tokens``
    against ``labels``, each depth's loss (its MTPLossLoggingHelper's tracker) and the logits
    (this rank's vocabulary shard): its GPTModel with depths computes them only with labels,
    so they are the output layer's last output (the depths' come before it)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    s = tokens.shape[1]
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    causal = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    outputs = []
    hook = model.output_layer.register_forward_hook(lambda m, i, out: outputs.append(out[0]))
    MTPLossLoggingHelper.tracker.clear()
    per_token = model.train()(tokens, positions, causal, labels=labels)
    hook.remove()
    per_token.mean().backward()  # as a training step's (the tracker is filled in the forward)
    depths = MTPLossLoggingHelper.tracker["values"].clone()
    logits = outputs[-1].detach().transpose(0, 1)  # [s, b, V/t] -> [b, s, V/t]
    return dict(logits=logits, loss=per_token.detach(), depths=depths)


def _gathered(result: dict) -> dict:
    """``result`` with its logits gathered over the tensor-parallel ranks' vocabulary shards."""
    from megatron.core import parallel_state as ps

    local = result["logits"].contiguous()
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return dict(result, logits=torch.cat(parts, -1))


def legacy_run(megatron_dir: str, tokens: torch.Tensor, labels: torch.Tensor) -> dict:
    """On each launched (tensor-parallel) rank: Megatron-Core's MTP GPTModel strictly loading
    its own rank's file of the legacy checkpoint in ``megatron_dir``; megatron_run's figures."""
    from megatron.core import parallel_state

    from megart.training import checkpoint
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_checkpoint import read_rank

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, 1)
    mcw.on_cpu_only()
    root = checkpoint.iteration_dir(megatron_dir, checkpoint.latest_iteration(megatron_dir))
    state = read_rank(root / f"mp_rank_{rank:02d}" / checkpoint.FILE)
    model = mcw.megatron_model(config_from_args(vars(state["args"])), tp)
    model.load_state_dict(state["model"], strict=True)
    out = _gathered(megatron_run(model, tokens, labels))
    torch.distributed.destroy_process_group()
    return out


def dist_run(dist_dir: str, tokens: torch.Tensor, labels: torch.Tensor, pp: int = 1) -> dict:
    """On each launched rank (tensor-parallel x ``pp`` pipeline ranks): Megatron-Core's MTP
    GPTModel of its stage loading its slices of the torch_dist store in ``dist_dir`` as
    Megatron-LM's loader does (mdw.load_and_run's way), strictly into the model; the pipeline
    run by hand (hidden states passed on); megatron_run's figures on the last stage (where the
    depths are), None elsewhere."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megart.training.checkpoint import iteration_dir, latest_iteration
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_dist import read_common

    tp = int(os.environ["WORLD_SIZE"]) // pp
    mdw._no_cuda()
    mdw._parallel(tp, pp)
    root = iteration_dir(dist_dir, latest_iteration(dist_dir))
    model = mcw.megatron_model(config_from_args(vars(read_common(root)["args"])), tp, pp)
    # Its last stage's copy of the embedding (the depths') is tied over the data-parallel
    # group Megatron-LM's metadata names (its GPTModel asks for it there).
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    wanted = {"model": model.sharded_state_dict(metadata=metadata)}
    loaded = dist_checkpointing.load(wanted, str(root), strict=mdw.STRICTNESS)
    model.load_state_dict(loaded["model"], strict=True)
    stage, group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
    out = None
    if stage > 0:
        shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)
        hidden = torch.empty(shape, dtype=torch.double)
        torch.distributed.recv(hidden, group=group, group_src=stage - 1)
        model.set_input_tensor(hidden)
    if stage < pp - 1:
        hidden = mcw.megatron_logits(model.eval(), tokens)  # a stage's output: hidden states
        torch.distributed.send(hidden.contiguous(), group=group, group_dst=stage + 1)
    else:
        out = _gathered(megatron_run(model, tokens, labels))
    torch.distributed.destroy_process_group()
    return out


def megart_run(cfg: GPTConfig, megatron_state: dict, tokens: torch.Tensor, labels: torch.Tensor):
    """megart's GPT (float64) holding Megatron-Core's whole state dict (no vocabulary padding):
    its logits, main per-token loss [b, s] and each depth's loss, as megatron_run's. The
    routers' expert biases (decoder's and depths') are set from the state's where it has them."""
    from megart.models.moe_router import load_expert_bias
    from megart.training.megatron_expert_bias import popped

    ours = GPT(cfg).double()
    megatron_state = dict(megatron_state)
    rows = popped(megatron_state, cfg)
    state = {k: v.double() for k, v in from_megatron(megatron_state, cfg).items()}
    ours.chunk.load_state_dict(state, strict=True)
    if rows is not None:
        load_expert_bias([ours.chunk], rows)
    with torch.no_grad():
        logits = ours(tokens)
    per_token = ours.chunk.token_losses(ours.chunk(tokens), labels, None)  # [s, b]
    per_token.mean().backward()
    tracked = ours.chunk.aux_loss_scale.take()["mtp"]
    depths = torch.stack([tracked[k] for k in range(cfg.mtp_num_layers)])
    return dict(logits=logits, loss=per_token.detach().t(), depths=depths)


def megart_run_kw(cfg_kw: dict, megatron_state: dict, tokens, labels) -> dict:
    """megart_run in the form launch calls (GPTConfig's fields)."""
    return megart_run(GPTConfig(**cfg_kw), megatron_state, tokens, labels)


def save_megatron(kw: dict, out_dir: str, tp: int, tokens, labels) -> dict:
    """mdw.save_megatron (Megatron-Core's MTP GPTModel at drawn weights, saved by its own
    dist_checkpointing on ``tp`` ranks) with megatron_run's figures in place of its logits
    (its GPTModel with depths computes logits only given labels)."""
    seen = {}

    def run(model, tokens, tp, pp):
        seen.update(_gathered(megatron_run(model, tokens, labels)))
        return seen["logits"]

    mdw.stage_logits = run
    mdw.save_megatron(kw, out_dir, tp, 1, tokens)
    return seen
