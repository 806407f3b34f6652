"""Megatron-Core's side of tests/test_megatron_dist_ep.py: its MoE GPTModel at expert-model-
parallel size 2 (parallel_state at tp 1, EP 2: SequentialMLP experts numbered globally in its
sharded state dict, CPU) and its ChainedOptimizer of two FP32Optimizers (the dense parameters',
the experts'), as get_megatron_optimizer builds them under expert parallelism, load megart's
torch_dist store through dist_checkpointing.load as Megatron-LM's load_checkpoint asks for it
(the store's content metadata passed to sharded_state_dict), and save what they then hold as
its save_checkpoint does. Also megart's saves with a mistake put in on purpose."""

from __future__ import annotations

import dataclasses
import os

import torch

EP = 2
MOMENTS = ("exp_avg", "exp_avg_sq")


def _held(optimizers: list, model) -> dict:
    """Per parameter piece of each optimizer of the chain, placed by Megatron-Core's own sharded
    tensors (store key, global offset, leading axes): the weight and both moments it holds."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    import megatron_dist_save_workers as w

    held = {"model": [], **{m: [] for m in MOMENTS}}
    for optimizer in optimizers:
        params = list(optimizer.get_parameters())
        by_id = get_param_id_to_sharded_param_map(model.sharded_state_dict(), params)
        assert len(by_id) == len(params), "a parameter Megatron-Core does not place"
        for i, sharded in by_id.items():
            state = optimizer.optimizer.state[params[i]]
            for what, tensor in (("model", params[i]), *((m, state[m]) for m in MOMENTS)):
                typed = {"dtype": tensor.dtype} if isinstance(sharded, ShardedTensor) else {}
                for piece in w._pieces(dataclasses.replace(sharded, data=tensor.detach(), **typed)):
                    held[what].append((piece.key, tuple(piece.global_offset),
                                       piece.prepend_axis_num, piece.data.clone()))  # fmt: skip
    return held


def load_and_save(kw: dict, store: str, out_dir: str | None, tokens: torch.Tensor) -> dict:
    """On each rank of 2 expert-parallel ranks (at ``kw``'s tensor and pipeline sizes):
    Megatron-Core's EP2 model and ChainedOptimizer load megart's store (Megatron-LM's default
    strictness: a key asked for that the store lacks fails), the model strictly. Returns what
    they hold (_held), the steps, the groups' sizes and expert flags per optimizer, the logits
    of ``tokens`` (float64; None with a pipeline); with ``out_dir`` saves them first as
    Megatron-LM does (no random states: its are CUDA streams)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    import megatron_dist_distopt_workers as mdd
    import megatron_dist_save_workers as w
    import megatron_dist_workers as mdw
    import megatron_optim_workers as mow
    import train_workers as tw
    from megart.training.checkpoint import iteration_dir, latest_iteration
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_dist import read_common
    from megatron_core_workers import megatron_logits, megatron_model
    from megatron_ep_start import megatron_ep

    tp = kw.get("tensor_model_parallel_size", 1)
    pp = kw.get("pipeline_model_parallel_size", 1)
    mdw._no_cuda()
    with megatron_ep(tp, pp, EP):
        c = tw.tiny(**kw)
        iteration = latest_iteration(store)
        root = iteration_dir(store, iteration)
        common = read_common(root)
        model = megatron_model(config_from_args(vars(common["args"])), tp, pp, ep=EP).float()
        groups = _get_param_groups([model], mow._optimizer_config(c), None)
        parts = [[g for g in groups if g["is_expert_parallel"] == x] for x in (False, True)]
        optimizers = [mow._fp32_optimizer(p, c) for p in parts]
        for o in optimizers:
            o.init_state_fn = w._init_state
        chain = ChainedOptimizer(optimizers)
        # Megatron-LM's load_checkpoint: the store's content metadata (None: {}), its group.
        content = dist_checkpointing.load_content_metadata(str(root))
        dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        metadata = {**(content or {}), "dp_cp_group": dp_cp}

        def wanted(is_loading: bool) -> dict:
            model_sd = model.sharded_state_dict(metadata=metadata)
            opt_sd = chain.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
            return {"model": model_sd, "optimizer": opt_sd}

        loaded = dist_checkpointing.load(wanted(True), str(root), strict=mdw.STRICTNESS)
        model.load_state_dict(loaded["model"], strict=True)
        chain.load_state_dict(loaded["optimizer"])
        held = _held(optimizers, model)
        steps = {float(s["step"]) for o in optimizers for s in o.optimizer.state.values()}
        if out_dir is not None:
            mdd.save_as_megatron_lm(out_dir, wanted(False), common, content)
        logits = None  # a pipeline stage's logits need the others' activations: not taken
        if pp == 1:
            model.double().eval()
            with torch.no_grad():
                logits = megatron_logits(model, tokens)
        return dict(held=held, steps=steps, logits=logits, rank=int(os.environ["RANK"]),
                    groups=[[(len(g["params"]), g["is_expert_parallel"]) for g in p]
                            for p in parts])  # fmt: skip


def _local_experts(places):
    """megart_dist_places.places with each expert at its LOCAL index (as the legacy files and
    the plain state dict number them) instead of its global one."""
    from megart.training.megatron_dist_keys import per_layer_keys

    def wrong(chunks, tp_rank, tp):
        out = places(chunks, tp_rank, tp)
        cfg = chunks[0].cfg
        at = 0 if per_layer_keys(cfg) else 1  # the expert's axis: after the layer's, if any
        for place in out:
            if getattr(place.param, "expert_parallel", False):
                place.offsets[at] %= cfg.num_experts // EP
        return out

    return wrong


def save_with_mistake(kw: dict, mistake: str) -> str:
    """megart's ep2 torch_dist save with ``mistake`` put in: "local-experts" (each expert under
    its local index) or "no-expert-replicas" (the experts written only where the dense weights
    are, as if their replica ids counted over the data-parallel ranks, not the expert-data-
    parallel ones). Returns what the save raised ("" if nothing)."""
    import megart.training.megatron_dist_train as mdt
    import train_workers as tw

    if mistake == "local-experts":
        mdt.places = _local_experts(mdt.places)
    elif mistake == "no-expert-replicas":
        rank_state = mdt.rank_state

        def dense_only(config, grid, *a, **k):
            return rank_state(config, grid, *a, **k) if grid.dp_cp_rank == 0 else {}

        mdt.rank_state = dense_only
    else:
        raise ValueError(mistake)
    try:
        tw.train_kw(kw)
    except Exception as e:  # noqa: BLE001 - the test asserts what was raised
        return f"{type(e).__name__}: {e}"
    return ""
