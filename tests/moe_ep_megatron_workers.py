"""Megatron-Core's own MoE GPTModel at expert-model-parallel size 2 (its parallel_state at tp 1,
EP 2; SequentialMLP experts, the allgather dispatcher, CPU, float64) on 2 launched processes,
for tests/test_moe_ep_megatron_ckpt.py: each rank strictly loading its own legacy file
(mp_rank_00_EEE) of megart's expert-parallel save, as Megatron-LM's load_checkpoint would.
megatron_core_resaves takes the run's tensor and pipeline sizes too (mp_rank_TT_PPP_EEE:
tests/test_moe_ep_megatron_stages.py)."""

from __future__ import annotations

from pathlib import Path

import torch

EP = 2


def logits_of_own_file(ckpt_dir: str, tokens: torch.Tensor) -> dict:
    """This rank's Megatron-Core model, built from its file's args and loading the file's
    ``model`` strictly (its experts under their local numbers); its logits of ``tokens`` and
    which file it read."""
    from megatron.core import parallel_state

    from megart.training.ckpt_files import FILE, iteration_dir, latest_iteration
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_files import torch_load
    from megatron_core_workers import megatron_logits, megatron_model
    from megatron_ep_start import megatron_ep

    with megatron_ep(1, 1, EP, megart_groups=True) as folder:
        e = parallel_state.get_expert_model_parallel_rank()
        path = iteration_dir(ckpt_dir, latest_iteration(ckpt_dir)) / folder / FILE
        state = torch_load(path)
        cfg = config_from_args(vars(state["args"]))
        model = megatron_model(cfg, ep=EP)
        extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
        model.load_state_dict({**state["model"], **extra}, strict=True)
        model.eval()
        with torch.no_grad():
            got = megatron_logits(model, tokens)
        return dict(logits=got, file=folder, rank=e)


def whole_logits(ckpt_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """megart's one-process GPT (float64) of the checkpoint's whole weights, as
    convert-checkpoint reads Megatron-LM's files (every expert-parallel rank's merged)."""
    from megart.models import GPT
    from megart.training.megatron_checkpoint import megatron_weights

    cfg, weights, _ = megatron_weights(ckpt_dir)
    ours = GPT(cfg)
    ours.chunk.load_state_dict(weights, strict=True)
    ours.eval()
    with torch.no_grad():
        return ours.double()(tokens)


def megatron_core_resaves(kw: dict, megart_dir: str, out_dir: str) -> dict:
    """On each rank of 2 expert-parallel ranks (at ``kw``'s tensor and pipeline sizes):
    Megatron-Core's GPTModel loads its file of megart's checkpoint (iteration 2) strictly and
    its optimizer, built as get_megatron_optimizer builds it under expert parallelism
    (Megatron-Core's _get_param_groups, its experts' groups apart, a ChainedOptimizer of two
    FP32Optimizers), loads the file's optimizer state; then it writes its own state dicts as
    Megatron-LM's generate_state_dict does (the file's args) into ``out_dir``. Returns its
    groups' sizes and expert flags per optimizer of the chain."""
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    import megatron_core_workers as mcw
    import megatron_optim_workers as mow
    import train_workers as tw
    from megart.training.megatron_args import config_from_args
    from megatron_ep_start import megatron_ep

    tp = kw.get("tensor_model_parallel_size", 1)
    pp = kw.get("pipeline_model_parallel_size", 1)
    with megatron_ep(tp, pp, EP) as folder:
        c = tw.tiny(**kw)
        here = f"{folder}/{mow.FILE}"
        state = torch.load(Path(megart_dir) / "iter_0000002" / here, weights_only=False)
        cfg = config_from_args(vars(state["args"]))
        model = mcw.megatron_model(cfg, tp, pp, ep=EP).float()
        model.load_state_dict(state["model"], strict=True)
        groups = _get_param_groups([model], mow._optimizer_config(c), None)
        parts = [[g for g in groups if g["is_expert_parallel"] == x] for x in (False, True)]
        optimizer = ChainedOptimizer([mow._fp32_optimizer(p, c) for p in parts])
        optimizer.load_state_dict(state["optimizer"])
        mow._write(out_dir, here, state["args"], model, optimizer, c)
        torch.distributed.barrier()
        return dict(groups=[[(len(g["params"]), g["is_expert_parallel"]) for g in p]
                            for p in parts])  # fmt: skip
