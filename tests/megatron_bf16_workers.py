"""Megatron-Core's side of the bf16 optimizer-state tests (one launched process per
tensor-parallel rank, CPU, gloo): its bf16 GPTModel and Float16OptimizerWithFloat16Params load
a rank's file of megart's ``--bf16`` checkpoint (fp32 masters included) and, given the
gradients and learning rate of megart train --half-weights' next step, step as it does.
Shared Megatron-Core set-up (parallel state, optimizer config, CUDA-named CPU tensors):
megatron_optim_workers."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_optim_workers import FILE, _cuda_named, _init, _optimizer_config


def _bf16_megatron(kw: dict, megart_dir: str) -> tuple:
    """This rank's Megatron-Core bf16 GPTModel, loaded strictly from its rank file of
    ``megart_dir``'s latest checkpoint, and Float16OptimizerWithFloat16Params over its own
    param groups (torch's AdamW inside) with the file's optimizer state, as Megatron-LM builds
    them without Apex; also the TrainConfig, the tensor-parallel rank and each bf16 parameter's
    fp32 main weight (by id)."""
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    import megatron_core_workers as mcw
    import train_workers as tw
    from megart.training.checkpoint import latest_iteration
    from megart.training.megatron_args import config_from_args

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    _init(tp)
    c = tw.tiny(**kw)
    root = Path(megart_dir) / f"iter_{latest_iteration(megart_dir):07d}"
    state = torch.load(root / f"mp_rank_{rank:02d}" / FILE, weights_only=False)
    cfg = config_from_args(vars(state["args"]))
    model = mcw.megatron_model(cfg, tp).to(torch.bfloat16)
    model.load_state_dict(state["model"], strict=True)
    config = _optimizer_config(c)
    config.bf16 = True
    groups = _get_param_groups([model], config, None)
    adamw = torch.optim.AdamW(groups, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
    with _cuda_named():
        optimizer = Float16OptimizerWithFloat16Params(adamw, config, None, None)
    optimizer.load_state_dict(state["optimizer"])
    main_of = {
        id(half): main
        for halves, mains in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups,
                                 strict=True)
        for half, main in zip(halves, mains, strict=True)
    }  # fmt: skip
    return c, rank, model, optimizer, main_of


def load_bf16(kw: dict, megart_dir: str) -> dict:
    """On each tensor-parallel rank: Megatron-Core's GPTModel in bf16 loads its rank's file of
    megart's --bf16 checkpoint strictly, and Float16OptimizerWithFloat16Params over its own
    param groups loads the optimizer state (fp32 masters included); whether each master is its
    parameter's (rounds to it) and each state has its parameter's shape."""
    _, _, model, optimizer, main_of = _bf16_megatron(kw, megart_dir)
    adamw = optimizer.optimizer
    pairs = [(p, main_of[id(p)]) for p in model.parameters()]
    states = [adamw.state[p] for g in adamw.param_groups for p in g["params"]]
    torch.distributed.destroy_process_group()
    return dict(
        masters=len(main_of),
        params=len(list(model.parameters())),
        masters_match=all(torch.equal(m.bfloat16(), h) for h, m in pairs),
        masters_differ=any(not torch.equal(m, h.float()) for h, m in pairs),
        shapes_match=all(
            s["exp_avg"].shape == p.shape and s["exp_avg_sq"].shape == p.shape
            for s, p in zip(
                states, [p for g in adamw.param_groups for p in g["params"]], strict=True
            )
        ),  # fmt: skip
        steps={float(s["step"]) for s in states},
    )


def megart_half_weights_step(kw: dict, megart_dir: str) -> dict:
    """On each tensor-parallel rank: megart train --bf16 --half-weights resumes ``megart_dir``'s
    checkpoint and trains one iteration; returns, under Megatron-Core's names and shapes, the
    fp32 gradients its step read (clipped), the learning rate, and the fp32 main weights and
    bf16 weights after the step."""
    from megart.training.megatron_files import chunk_names_to_megatron
    from megart.training.trainer import Trainer
    from train_workers import builtin_corpus, tiny

    trainer = Trainer(tiny(**kw, load=megart_dir), tokens=builtin_corpus(1 << 16))
    (chunk,) = trainer.chunks
    opt = trainer.optimizer
    main_of = {id(p): m for p, m in zip(opt.params, opt.mains, strict=True)}
    named = list(chunk.named_parameters())
    seen: dict = {}
    step = opt.step

    def recording_step() -> None:
        seen["grads"] = {n: p.main_grad.clone() for n, p in named}
        seen["lr"] = opt.param_groups[0]["lr"]
        step()

    opt.step = recording_step
    trainer.train_step(trainer.start_iteration)

    def megatron_names(tensors: dict) -> dict:
        return chunk_names_to_megatron(tensors, chunk.cfg, list(chunk.layer_ids))

    return dict(
        grads=megatron_names(seen["grads"]),
        lr=seen["lr"],
        mains=megatron_names({n: main_of[id(p)].clone() for n, p in named}),
        weights=megatron_names({n: p.detach().clone() for n, p in named}),
    )


def megatron_bf16_step(kw: dict, megart_dir: str, megart_side: str) -> dict:
    """On each tensor-parallel rank: Megatron-Core's bf16 GPTModel and
    Float16OptimizerWithFloat16Params load ``megart_dir``'s rank file (_bf16_megatron), take
    megart's gradients of the next iteration as ``main_grad`` and the learning rate it used
    (weight decay as Megatron's scheduler sets it, wd_mult times --weight-decay), and step
    (clipping off: the gradients come clipped); returns the largest differences of its fp32
    main weights from megart's and of its bf16 weights from megart's, and whether each of its
    weights is its main weight rounded."""
    c, rank, model, optimizer, main_of = _bf16_megatron(kw, megart_dir)
    ours = torch.load(megart_side, weights_only=False)[rank]  # megart_half_weights_step's
    optimizer.config.clip_grad = 0.0
    for group in optimizer.param_groups:
        group["lr"] = ours["lr"]
        group["weight_decay"] = c.weight_decay * group["wd_mult"]
    named = dict(model.named_parameters())
    before = {n: main_of[id(p)].clone() for n, p in named.items()}
    for name, p in named.items():
        p.main_grad = ours["grads"][name].clone()
    with _cuda_named():
        optimizer.step()
    torch.distributed.destroy_process_group()
    return dict(
        params=len(named),
        main_diff=max(
            (main_of[id(p)] - ours["mains"][n]).abs().max().item() for n, p in named.items()
        ),  # fmt: skip
        weights_differing=sum(
            int((p.detach() != ours["weights"][n]).sum()) for n, p in named.items()
        ),  # fmt: skip
        rounded=all(torch.equal(main_of[id(p)].bfloat16(), p.detach()) for p in named.values()),
        moved=max((main_of[id(p)] - before[n]).abs().max().item() for n, p in named.items()),
    )
