"""Megatron-Core's side of tests/test_megatron_dist_ep_distopt.py (megatron-core 0.16.1, CPU,
gloo; one launched process per rank of expert-parallel 2 x data-parallel 4, or with a pipeline):
its own MoE GPTModel, one DistributedDataParallel (dense and expert buffers) and the
ChainedOptimizer of two DistributedOptimizers get_megatron_optimizer builds under expert
parallelism (the dense parameters' over data x context parallelism numbered by the rank's place
in the model-parallel group; the experts' over the expert-data-parallel group numbered by its
place in the expert tensor x expert x pipeline group: moe_ep_megatron_distopt_workers._chained)
load megart's torch_dist store as Megatron-LM's load_checkpoint asks for it (the store's content
metadata to sharded_state_dict, dist_checkpointing.load, load_state_dict of each), and save what
they then hold as its save_checkpoint does. Also megart's saves with a mistake put in on purpose.
The CUDA stubs are megatron_distopt_workers' and megatron_dist_distopt_workers'."""

from __future__ import annotations

import re

import torch

EP = 2
KEYS = ("param", "exp_avg", "exp_avg_sq")


def _global(name: str, ep_rank: int, per: int) -> str:
    """A Megatron-Core parameter's name with its local expert number made global."""
    return re.sub(
        r"(\.local_experts\.)(\d+)\.", lambda m: f"{m[1]}{int(m[2]) + ep_rank * per}.", name
    )


def load_and_save(kw: dict, store: str, out_dir: str | None) -> dict:
    """On each rank: Megatron-Core's model and chained distributed optimizers load megart's
    store (Megatron-LM's default strictness), the model strictly. Returns, per parameter piece
    each optimizer of the chain holds (under the one-chunk model's Megatron name, experts by
    global number), its range in the flattened parameter and its fp32 main copy and moments;
    the steps, the content metadata and the groups' expert flags. With ``out_dir``, saves
    them first as Megatron-LM does (iteration and scheduler as the store's)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    import megatron_core_workers as mcw
    import megatron_dist_distopt_workers as mdd
    import megatron_dist_workers as mdw
    import megatron_distopt_workers as mdo
    from megart.training.checkpoint import iteration_dir, latest_iteration
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_dist import read_common
    from megatron_ep_start import megatron_ep
    from moe_ep_megatron_distopt_workers import _chained
    from test_megatron_dist_distopt import _global_name

    mdw._no_cuda()
    root = iteration_dir(store, latest_iteration(store))
    common = read_common(root)
    args = vars(common["args"])
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    with megatron_ep(tp, pp, EP):
        cfg = config_from_args(args)
        dtype = torch.bfloat16 if args.get("bf16") else torch.float32
        sp = bool(args.get("sequence_parallel"))
        model = mcw.megatron_model(cfg, tp, pp, ep=EP, sequence_parallel=sp).to(dtype)
        ddp, chain = _chained(model, kw, args)
        with mcw.cuda_stays_on_cpu():
            for part in chain.chained_optimizers:
                mdd._fresh_state(part)
        content = dist_checkpointing.load_content_metadata(str(root))
        metadata = {
            **content,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
        }

        def wanted(is_loading: bool) -> dict:
            out = {"model": model.sharded_state_dict(metadata=metadata)}
            out["optimizer"] = chain.sharded_state_dict(
                out["model"], is_loading=is_loading, metadata=metadata
            )
            return out

        with mcw.cuda_stays_on_cpu():
            asked = wanted(True)
        loaded = dist_checkpointing.load(asked, str(root), strict=mdw.STRICTNESS)
        model.load_state_dict(loaded["model"], strict=True)
        with torch.no_grad(), mdo._step_kept(), mcw.cuda_stays_on_cpu():
            chain.load_state_dict(loaded["optimizer"])
        e, p = ps.get_expert_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        per = cfg.num_experts // EP
        pieces = {}
        for i, part in enumerate(chain.chained_optimizers):
            for (_, name), (r, held, numel) in mdo.held_pieces(part, [ddp]).items():
                whole = _global_name(_global(name, e, per), 0, p, common["args"])
                piece = {k: held[k].detach().clone() for k in KEYS}
                pieces[i, whole, r.start] = dict(piece, range=(r.start, r.end), numel=numel)
        steps = {float(s["step"]) for o in chain.chained_optimizers
                 for s in o.optimizer.state.values()}  # fmt: skip
        groups = [[g["is_expert_parallel"] for g in o.optimizer.param_groups]
                  for o in chain.chained_optimizers]  # fmt: skip
        if out_dir is not None:
            mdd.save_as_megatron_lm(out_dir, wanted(False), common, content)
        return dict(pieces=pieces, steps=steps, content=content, groups=groups,
                    place=(ps.get_tensor_model_parallel_rank(), p, e,
                           ps.get_expert_data_parallel_rank()))  # fmt: skip


def save_with_mistake(kw: dict, mistake: str) -> str:
    """megart's save with ``mistake`` put in: "experts-over-dp" (the experts' buffers sharded
    over the data-parallel ranks, as the dense ones, instead of their expert-data-parallel
    group), "experts-by-mp-rank" (the experts' optimizer numbered by the rank's place in the
    model-parallel group, as the dense one, so both expert-parallel ranks write one key) or
    "swapped-chain" (the chain's labels swapped: the experts under ``chained_0.``). Returns what
    the save raised ("" if nothing)."""
    import dataclasses

    import megart.training.megatron_dist_chain as mdc
    import train_workers as tw

    parts = mdc.parts

    def wrong(grid, tp, ep, args):
        dense, experts = parts(grid, tp, ep, args)
        if mistake == "experts-over-dp":
            experts = dataclasses.replace(experts, shard=dense.shard, rank=dense.rank)
        elif mistake == "experts-by-mp-rank":
            mp = dense.prefix.removeprefix(mdc.CHAIN[0])
            experts = dataclasses.replace(experts, prefix=mdc.CHAIN[1] + mp)
        elif mistake == "swapped-chain":
            dense, experts = (
                dataclasses.replace(dense, prefix=dense.prefix.replace(*mdc.CHAIN)),
                dataclasses.replace(experts, prefix=experts.prefix.replace(*mdc.CHAIN[::-1])),
            )
        else:
            raise ValueError(mistake)
        return [dense, experts]

    mdc.parts = wrong
    try:
        tw.train_kw(kw)
    except Exception as e:  # noqa: BLE001 - the test asserts what was raised
        return f"{type(e).__name__}: {e}"
    return ""
