"""Megatron-Core's side of the tests of megart train's torch_dist saves: on launched gloo ranks,
its GPTModel (local spec) and FP32Optimizer (over torch's AdamW, as Megatron-LM builds it
without Apex or Transformer Engine) load their sharded state dict from megart's store through
dist_checkpointing.load, as Megatron-LM's load_checkpoint asks for it; what they then hold is
returned piece by piece, each piece placed by Megatron-Core's own sharded tensors."""

from __future__ import annotations

import dataclasses
import os

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def _pieces(sharded) -> list:
    """The ShardedTensors of a model parameter's sharded entry (a factory, SwiGLU's fc1,
    builds two)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(sharded, ShardedTensorFactory):
        built = sharded.build()
        return list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
    return [sharded]


def _init_state(opt, config=None) -> None:
    """What get_megatron_optimizer's closure for Adam does before a sharded load (it cannot be
    imported): zero moments of each parameter's shape, which the load fills."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def _model_and_optimizer(cfg, tp: int, pp: int, c, args) -> tuple:
    """Megatron-Core's GPTModel of this rank and its optimizer as get_megatron_optimizer builds
    them for the store's args: FP32Optimizer, or with --bf16 a bf16 model under
    Float16OptimizerWithFloat16Params (fp32 main params), over torch's AdamW; and the AdamW."""
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    import megatron_optim_workers as mow
    from megatron_core_workers import megatron_model

    model = megatron_model(cfg, tp, pp).float()
    config = mow._optimizer_config(c)
    if not args.bf16:
        optimizer = mow._fp32_optimizer(_get_param_groups([model], config, None), c)
        optimizer.init_state_fn = _init_state
        return model, optimizer, optimizer.optimizer
    assert not args.fp16, "an fp16 store needs Megatron's grad scaler, not built here"
    model = model.to(torch.bfloat16)
    config.bf16 = True
    adam = torch.optim.AdamW(_get_param_groups([model], config, None), lr=c.lr)
    with mow._cuda_named():
        optimizer = Float16OptimizerWithFloat16Params(adam, config, None, _init_state)
    return model, optimizer, adam


def megatron_loads(store: str, tp: int, pp: int, kw: dict) -> dict:
    """On each of tp x pp launched ranks: Megatron-Core's model and optimizer load the store
    (Megatron-LM's default strictness: a key asked for that the store lacks fails), then the
    model strictly. Returns, per parameter piece as Megatron-Core places it (store key, global
    offset, the number of leading layer axes), the model's tensor (bf16 under --bf16), its fp32
    main copy and both Adam moments it holds; the optimizer's steps; and this rank's random
    states as Megatron-LM's loader reads them."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    import megatron_dist_workers as mdw
    import train_workers as tw
    from megart.training.checkpoint import iteration_dir, latest_iteration
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_dist import read_common

    mdw._no_cuda()
    mdw._parallel(tp, pp)
    c = tw.tiny(**kw)
    root = iteration_dir(store, latest_iteration(store))
    args = read_common(root)["args"]
    model, optimizer, adam = _model_and_optimizer(config_from_args(vars(args)), tp, pp, c, args)
    model_sd = model.sharded_state_dict()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # As Megatron-LM's generate_state_dict nests them (get_rng_state's ShardedObject).
    wanted = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True),
        "rng_state": ShardedObject("rng_state", None, (pp, tp), (pp_rank, tp_rank), replica_id=0),
    }
    loaded = dist_checkpointing.load(wanted, str(root), strict=mdw.STRICTNESS)
    model.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    # The model's parameters, and each one's fp32 main copy (the parameter itself in fp32).
    if hasattr(optimizer, "float16_groups"):
        params = [p for g in optimizer.float16_groups for p in g]
        mains = [p for g in optimizer.fp32_from_float16_groups for p in g]
    else:
        params = mains = list(optimizer.get_parameters())
    by_id = get_param_id_to_sharded_param_map(model.sharded_state_dict(), params)
    assert len(by_id) == len(params), "a parameter Megatron-Core does not place"
    held = {"model": [], "main": [], **{m: [] for m in MOMENTS}}
    for i, sharded in by_id.items():
        state = adam.state[mains[i]]
        tensors = (("model", params[i]), ("main", mains[i]), *((m, state[m]) for m in MOMENTS))
        for what, tensor in tensors:
            # As make_sharded_optimizer_tensor does: the same placing, this tensor's data.
            typed = {"dtype": tensor.dtype} if isinstance(sharded, ShardedTensor) else {}
            for piece in _pieces(dataclasses.replace(sharded, data=tensor.detach(), **typed)):
                held[what].append(
                    (piece.key, tuple(piece.global_offset), piece.prepend_axis_num,
                     piece.data.clone())
                )  # fmt: skip
    steps = {float(s["step"]) for s in adam.state.values()}
    rng = loaded["rng_state"][0]
    torch.distributed.destroy_process_group()
    return {"held": held, "steps": steps, "rank": int(os.environ["RANK"]),
            "rng_torch": rng["torch_rng_state"], "rng_keys": sorted(rng)}  # fmt: skip
