"""Megatron-Core's side of the torch_dist distributed-optimizer tests (megatron-core 0.16.1,
CPU, gloo; one launched process per rank): its GPTModel, DistributedDataParallel and
DistributedOptimizer (built as megatron_distopt_workers builds them, as Megatron-LM's
get_model and get_megatron_optimizer do) load megart's store as Megatron-LM's load_checkpoint
asks for it (the model's and DistributedOptimizer.sharded_state_dict's entries, the sharding
type from the store's content metadata, dist_checkpointing.load, then load_state_dict of
each), and save what they then hold as its save_checkpoint does (dist_checkpointing.save with
the content metadata), for megart to resume.

Stubbed beyond megatron_distopt_workers' stubs: with torch's Adam (no Apex or Transformer
Engine on this CPU) DistributedOptimizer.state_dict() asserts one step over a state that a
fresh optimizer does not have yet, and sharded_state_dict calls it first; Megatron-LM's runs
(Transformer Engine's FusedAdam) keep the step in the param groups and do not. The fresh
optimizer is given its state first through its own load_state_dict of its own param groups
at step 0 (which allocates the moments, as its load path does); the load then overwrites it.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def _fresh_state(optimizer) -> None:
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "step": 0.0}
        for g in optimizer.optimizer.param_groups
    ]
    optimizer.load_state_dict({"optimizer": {"param_groups": groups}})


def save_as_megatron_lm(out_dir: str, sharded: dict, common: dict, content: dict | None) -> None:
    """On every rank: Megatron-LM's save_checkpoint of ``sharded`` (the model's and optimizer's
    sharded state dicts) with the loaded store's ``common`` args, iteration and scheduler (no
    rng_state: Megatron-LM's are CUDA streams; megart then keeps its own) and ``content``
    metadata, into ``out_dir`` at that iteration; rank 0 writes the tracker."""
    from megatron.core import dist_checkpointing

    from megart.training.checkpoint import iteration_dir

    iteration = common["iteration"]
    out = iteration_dir(out_dir, iteration)
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True)
    torch.distributed.barrier()
    state = {**sharded, "args": common["args"], "checkpoint_version": 3.0,
             "iteration": iteration,
             "opt_param_scheduler": common["opt_param_scheduler"]}  # fmt: skip
    # Megatron-Core's writer hands the bytes to helper processes (megatron_dist_workers).
    multiprocessing.current_process()._config["daemon"] = False
    dist_checkpointing.save(state, str(out), content_metadata=content)
    if torch.distributed.get_rank() == 0:
        (Path(out_dir) / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def load_and_save(kw: dict, store: str, out_dir: str | None) -> dict:
    """On each rank: Megatron-Core's model and distributed optimizer load megart's store
    (Megatron-LM's default strictness); returns, per parameter piece this rank's optimizer
    holds, its range in the parameter and its fp32 main copy and moments, plus the steps and
    the content metadata it read. With ``out_dir``, saves them as Megatron-LM does (iteration
    and scheduler as the store's)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import megatron_core_workers as mcw
    import megatron_dist_workers as mdw
    import megatron_distopt_workers as mdo
    import megatron_optim_workers as mow
    from megart.training.checkpoint import iteration_dir, latest_iteration
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_dist import read_common

    mdw._no_cuda()
    iteration = latest_iteration(store)
    root = iteration_dir(store, iteration)
    common = read_common(root)
    args = vars(common["args"])
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    per = args.get("num_layers_per_virtual_pipeline_stage")
    vp = args["num_layers"] // (pp * per) if per else None
    # The model's weights do not depend on context parallelism (its TransformerConfig says
    # cp 1, which Megatron-Core's local attention requires); the parallel state's groups do:
    # the replica ids and the optimizer's shards run over data x context parallelism.
    mow._init(tp, pp, vp, int(args.get("context_parallel_size") or 1))
    cfg = config_from_args(args)
    dtype = torch.bfloat16 if args.get("bf16") else torch.float16 if args.get("fp16") else None
    # As Megatron-LM's get_model: a model and a DistributedDataParallel per model chunk
    # (bucketed on the first pipeline stage's first chunk only), one optimizer over them.
    ddps = []
    for i in range(vp or 1):
        model = mcw.megatron_model(cfg, tp, pp, i if vp else None).to(dtype or torch.float32)
        ddps.append(mdo._ddp(model, args, args.get("ddp_bucket_size"), chunk=i))
    optimizer = mdo._distributed_optimizer(ddps, kw, args)
    with mcw.cuda_stays_on_cpu():
        _fresh_state(optimizer)
    # Megatron-LM's load_checkpoint: the content metadata from the store, its dp group added.
    content = dist_checkpointing.load_content_metadata(str(root))
    metadata = {**content, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    d = ps.get_data_parallel_rank(with_context_parallel=True)

    keys = ["model"] if len(ddps) == 1 else [f"model{i}" for i in range(len(ddps))]

    def wanted(is_loading: bool) -> dict:
        # Megatron-LM's generate_state_dict: "model" (or "model0", "model1", ... per chunk),
        # then the optimizer's entries given all of them.
        out = {
            k: d.module.sharded_state_dict(metadata=metadata)
            for k, d in zip(keys, ddps, strict=True)
        }
        out["optimizer"] = optimizer.sharded_state_dict(
            out, is_loading=is_loading, metadata=metadata
        )
        return out

    with mcw.cuda_stays_on_cpu():  # sharded_state_dict reloads the grad scaler's state
        asked = wanted(True)
    loaded = dist_checkpointing.load(asked, str(root), strict=mdw.STRICTNESS)
    for key, ddp in zip(keys, ddps, strict=True):
        ddp.module.load_state_dict(loaded[key], strict=True)
    with torch.no_grad(), mdo._step_kept(), mcw.cuda_stays_on_cpu():
        optimizer.load_state_dict(loaded["optimizer"])
    pieces = {}
    for place, (r, held, _) in mdo.held_pieces(optimizer, ddps).items():
        piece = {k: held[k].detach().clone() for k in ("param", *MOMENTS)}
        pieces[place] = dict(piece, range=(r.start, r.end))
    steps = {float(s["step"]) for s in optimizer.optimizer.state.values()}
    scaler = optimizer.grad_scaler.state_dict() if optimizer.grad_scaler else None
    if out_dir is not None:
        save_as_megatron_lm(out_dir, wanted(False), common, content)
    torch.distributed.destroy_process_group()
    buckets = [[b.numel_unpadded for b in ddp.buffers[0].buckets] for ddp in ddps]
    return dict(place=(tp_rank, pp_rank, d), pieces=pieces, steps=steps, content=content,
                buckets=buckets,
                scaler=scaler, rank=int(os.environ["RANK"]))  # fmt: skip
