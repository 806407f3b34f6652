"""Megatron-Core's side of the optimizer-state tests (one launched process per tensor-parallel
rank, CPU, gloo): its GPTModel loads a rank's file of megart's ``--ckpt-format torch``
checkpoint strictly, Megatron-Core's own ``_get_param_groups`` and FP32Optimizer (over torch's
AdamW, as Megatron-LM builds it without Apex or Transformer Engine) load the file's optimizer
state, and it trains on megart's batches by hand: the loss of the whole global batch (padding
logits masked, as megart's), gradient clipping by the global norm, the given learning rates.
What it writes is what Megatron-LM's generate_state_dict writes, from Megatron-Core's own
state dicts. Its set-up helpers serve the other Megatron-Core workers too; the bf16 side
(Float16OptimizerWithFloat16Params): megatron_bf16_workers."""

from __future__ import annotations

import argparse
import contextlib
import os
import random
from pathlib import Path

import numpy as np
import torch

from megart.training.config import TrainConfig
from megart.training.megatron_mla import mla_args

FILE = "model_optim_rng.pt"


def _init(tp: int, pp: int = 1, vp: int | None = None, cp: int = 1) -> None:
    """Megatron-Core's parallel state of the launched world (``vp`` model chunks per pipeline
    rank under interleaving, ``cp`` context-parallel ranks)."""
    from megatron.core import parallel_state

    from megatron_core_workers import on_cpu_only

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tp, pp, vp, context_parallel_size=cp)
    # No CUDA: the tracker's fork, buffers on "the current CUDA device", an MoE router's gate.
    on_cpu_only()


def _fp32_optimizer(groups: list[dict], c: TrainConfig):
    """Megatron-Core's FP32Optimizer over torch's AdamW, as get_megatron_optimizer builds it
    (its constructor's one CUDA tensor, a unit scale, made on the CPU instead)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    adamw = torch.optim.AdamW(groups, lr=c.lr, weight_decay=c.weight_decay,
                              betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)  # fmt: skip
    real = torch.tensor

    def on_cpu(*a, device=None, **kw):
        return real(*a, device="cpu" if device == "cuda" else device, **kw)

    torch.tensor = on_cpu
    try:
        return FP32Optimizer(adamw, _optimizer_config(c), None)
    finally:
        torch.tensor = real


def _optimizer_config(c: TrainConfig):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=c.lr, min_lr=c.min_lr,
                           decoupled_lr=c.decoupled_lr, decoupled_min_lr=c.decoupled_min_lr,
                           weight_decay=c.weight_decay, adam_beta1=c.adam_beta1,
                           adam_beta2=c.adam_beta2, adam_eps=c.adam_eps,
                           clip_grad=c.clip_grad)  # fmt: skip


def _loss(model, cfg, tokens: torch.Tensor, targets: torch.Tensor, tp: int, rank: int):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True: the future, masked
    if cfg.mtp_num_layers:  # its depths need the labels: its own loss (an unpadded vocabulary)
        assert cfg.padded_vocab_size(tp) == cfg.vocab_size
        return model(tokens, positions, mask, labels=targets).mean()  # the depths' seeded
    logits = model(tokens, positions, mask)  # [b, s, V_padded / t]
    per = logits.shape[-1]
    padded = torch.arange(rank * per, (rank + 1) * per) >= cfg.vocab_size
    logits = logits.masked_fill(padded, float("-inf"))  # megart leaves the padding out
    return vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                        targets.t().contiguous()).mean()  # fmt: skip


def _clip(model, max_norm: float) -> None:
    """Megatron's clipping: the norm over every rank's tensor-parallel shards and the
    replicated parameters once, coefficient max_norm / (norm + 1e-6)."""
    split = [p.grad for p in model.parameters() if getattr(p, "tensor_model_parallel", False)]
    rest = [p.grad for p in model.parameters() if not getattr(p, "tensor_model_parallel", False)]
    sq = torch.stack([g.double().pow(2).sum() for g in split]).sum() if split else torch.zeros(())
    torch.distributed.all_reduce(sq)
    total = sq + sum(g.double().pow(2).sum() for g in rest)
    coef = max_norm / (float(total.sqrt()) + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            p.grad.mul_(coef)


def _write(out_dir: str, here: str, args, model, optimizer, c: TrainConfig) -> None:
    """This rank's file of a legacy checkpoint, as Megatron-LM's generate_state_dict assembles
    it from Megatron-Core's state dicts (``model`` a list of model chunks under interleaving:
    ``model0``, ``model1``, ...); rank 0 writes the tracker."""
    iteration = args.iteration
    chunks = model if isinstance(model, list) else [model]
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    written = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        **{key: m.state_dict() for key, m in zip(keys, chunks, strict=True)},
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": _scheduler_state(c, iteration),
        "rng_state": [{
            "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
            "rng_tracker_states": {},
        }],
    }  # fmt: skip
    path = Path(out_dir) / f"iter_{iteration:07d}" / here
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(written, path)
    if int(os.environ["RANK"]) == 0:
        (Path(out_dir) / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def _args(cfg, c: TrainConfig, tp: int, iteration: int, pp: int = 1) -> argparse.Namespace:
    """Megatron-LM's argparse fields of the run (the model's and the schedule's)."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_size, num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.query_groups, kv_channels=cfg.head_dim,
        seq_length=cfg.seq_length, max_position_embeddings=cfg.seq_length,
        # As a run with Megatron's GPT2BPETokenizer records it: the padded size alone.
        vocab_size=None, padded_vocab_size=cfg.padded_vocab_size(tp),
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=cfg.layernorm_epsilon,
        position_embedding_type="rope" if cfg.position_embedding == "rotary"
        else "learned_absolute",
        rotary_base=int(cfg.rotary_base), rotary_interleaved=cfg.rotary_interleaved,
        swiglu=cfg.activation == "swiglu", add_bias_linear=cfg.bias,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, lr=c.lr, min_lr=c.min_lr,
        train_iters=c.train_iters, global_batch_size=c.global_batch_size,
        micro_batch_size=c.micro_batch_size, iteration=iteration,
        consumed_train_samples=iteration * c.global_batch_size, ckpt_format="torch",
        use_distributed_optimizer=False, fp16=False, bf16=False,
        decoupled_lr=c.decoupled_lr, decoupled_min_lr=c.decoupled_min_lr,
        qk_layernorm=cfg.qk_layernorm, **mla_args(cfg),  # MLA's flags (or their defaults)
        softmax_type=cfg.softmax_type,
    )  # fmt: skip


def _scheduler(c: TrainConfig, optimizer):
    """Megatron-Core's OptimizerParamScheduler over ``optimizer``'s param groups (each with
    its max_lr and min_lr), built as Megatron-LM's get_optimizer_param_scheduler builds it
    from these flags; it counts samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = c.global_batch_size
    # Megatron-LM's validate_args sets both ends to --weight-decay for a constant decay.
    constant = c.weight_decay_incr_style == "constant"
    start = c.weight_decay if constant else c.start_weight_decay
    end = c.weight_decay if constant else c.end_weight_decay
    anneal = c.lr_wsd_decay_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=c.lr, min_lr=c.min_lr,
        lr_warmup_steps=c.lr_warmup_iters * gbs, lr_decay_steps=c.train_iters * gbs,
        lr_decay_style=c.lr_decay_style, start_wd=start, end_wd=end,
        wd_incr_steps=c.train_iters * gbs, wd_incr_style=c.weight_decay_incr_style,
        wsd_decay_steps=None if anneal is None else anneal * gbs,
        lr_wsd_decay_style=c.lr_wsd_decay_style,
    )  # fmt: skip


def _scheduler_state(c: TrainConfig, iteration: int) -> dict:
    """The scheduler's state after ``iteration`` global batches."""

    class Stub:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    sched = _scheduler(c, Stub())
    for _ in range(iteration):
        sched.step(increment=c.global_batch_size)
    return sched.state_dict()


def resume_and_write(kw: dict, megart_dir: str, out_dir: str) -> dict:
    """On each tensor-parallel rank: Megatron-Core loads its rank's file of megart's
    checkpoint at iteration 1 (model strictly, optimizer through FP32Optimizer), trains
    iterations 2 and 3 on megart's batches, each param group at the rate its
    OptimizerParamScheduler gives it (--decoupled-lr's group its own); returns its losses and
    rates, the largest difference of its weights after iteration 2 from megart's (the file
    megart wrote then) and its param groups' Megatron keys. Writes, as Megatron-LM does, its
    own legacy checkpoint of iteration 3 to ``out_dir``."""
    from megatron.core.optimizer import _get_param_groups

    import megatron_core_workers as mcw
    import train_workers as tw
    from megart.training.data import build_datasets, builtin_corpus
    from megart.training.megatron_args import config_from_args

    tp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    _init(tp)
    c = tw.tiny(**kw)
    here = f"mp_rank_{rank:02d}/{FILE}"
    state = torch.load(Path(megart_dir) / "iter_0000001" / here, weights_only=False)
    cfg = config_from_args(vars(state["args"]))
    model = mcw.megatron_model(cfg, tp).float()
    model.load_state_dict(state["model"], strict=True)
    groups = _get_param_groups([model], _optimizer_config(c), None)
    optimizer = _fp32_optimizer(groups, c)
    if c.decoupled_lr is None:
        optimizer.load_state_dict(state["optimizer"])
    else:
        # megatron-core 0.16.1 pairs saved groups with its own by (wd_mult, lr_mult,
        # is_expert_parallel, is_decoupled_lr), which its --decoupled-lr group shares with the
        # default one, so it cannot load its own state of such a run (Megatron-LM's main added
        # max_lr and min_lr to those keys later). The torch load that method ends in takes the
        # groups in order.
        optimizer.optimizer.load_state_dict(state["optimizer"])
    data, _, _ = build_datasets(None, c.split, c.seq_length, c.vocab_size,
                                builtin_corpus(1 << 16), evaluate=False)  # fmt: skip
    after = torch.load(Path(megart_dir) / "iter_0000002" / here, weights_only=False)["model"]
    losses, rates, weights_diff = [], [], None
    scheduler = _scheduler(c, optimizer)
    scheduler.step(increment=c.global_batch_size)  # one global batch consumed before
    for iteration in (1, 2):
        tokens, targets = data.global_batch(c.seed, iteration, c.global_batch_size)
        model.zero_grad()
        loss = _loss(model, cfg, tokens, targets, tp, rank)
        loss.backward()
        losses.append(loss.item())
        _clip(model, c.clip_grad)
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.optimizer.step()
        scheduler.step(increment=c.global_batch_size)
        if weights_diff is None:
            weights_diff = max(
                (p.detach() - after[n]).abs().max().item() for n, p in model.named_parameters()
            )
    _write(out_dir, here, _args(cfg, c, tp, 3), model, optimizer, c)
    torch.distributed.barrier()
    keys = [{k: g[k] for k in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")}
            | {"size": len(g["params"])} for g in optimizer.param_groups]  # fmt: skip
    torch.distributed.destroy_process_group()
    return dict(losses=losses, rates=rates, weights_diff=weights_diff, groups=keys)


@contextlib.contextmanager
def _cuda_named():
    """Megatron-Core's mixed-precision optimizer takes only CUDA tensors (it checks their
    type names) and makes a few CUDA scalars: on this CPU-only process, CPU ones named so."""
    real_type, real_tensor = torch.Tensor.type, torch.tensor

    def type_(self, *a, **kw):
        return real_type(self, *a, **kw) if a or kw else real_type(self).replace(".", ".cuda.", 1)

    def tensor(*a, device=None, **kw):
        return real_tensor(*a, device="cpu" if device == "cuda" else device, **kw)

    torch.Tensor.type, torch.tensor = type_, tensor
    try:
        yield
    finally:
        torch.Tensor.type, torch.tensor = real_type, real_tensor


def pipeline_states(kw: dict, megart_dir: str, out_dir: str | None = None) -> dict:
    """On each pipeline rank (the world: pipeline-parallel, tensor-parallel 1): Megatron-Core's
    GPTModel of this stage loads its file of megart's checkpoint strictly and FP32Optimizer over
    its own param groups loads the optimizer state; Adam's ``exp_avg`` of each of its
    parameters, named as the one-stage model names it (layers numbered from the stage's
    offset, a tied output layer as the word embedding it copies). With ``out_dir``, writes
    what it holds as Megatron-LM's legacy checkpoint there."""
    from megatron.core.optimizer import _get_param_groups

    import megatron_core_workers as mcw
    import train_workers as tw
    from megart.training.checkpoint import latest_iteration
    from megart.training.megatron_args import config_from_args

    pp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    _init(1, pp)
    c = tw.tiny(**kw)
    root = Path(megart_dir) / f"iter_{latest_iteration(megart_dir):07d}"
    name = f"mp_rank_00_{rank:03d}" if pp > 1 else "mp_rank_00"
    state = torch.load(root / name / FILE, weights_only=False)
    cfg = config_from_args(vars(state["args"]))
    model = mcw.megatron_model(cfg, 1, pp).float()
    model.load_state_dict(state["model"], strict=True)
    optimizer = _fp32_optimizer(_get_param_groups([model], _optimizer_config(c), None), c)
    optimizer.load_state_dict(state["optimizer"])
    offset = rank * cfg.num_layers // pp
    out = {}
    for n, p in model.named_parameters():
        parts = n.split(".")
        if n.startswith("decoder.layers."):
            parts[2] = str(int(parts[2]) + offset)
        if n == "output_layer.weight" and not cfg.untie_embeddings_and_output_weights:
            parts = ["embedding", "word_embeddings", "weight"]
        out[".".join(parts)] = optimizer.optimizer.state[p]["exp_avg"].clone()
    if out_dir is not None:
        args = _args(cfg, c, 1, state["iteration"], pp)
        _write(out_dir, f"{name}/{FILE}", args, model, optimizer, c)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return out


def megatron_rates(
    states: list[dict], anneal: int | None = None, anneal_style: str | None = None
) -> list[float]:
    """Megatron-Core's OptimizerParamScheduler, built with other values and loaded from each
    saved state (as Megatron's --use-checkpoint-opt_param-scheduler does): the rate of the
    next step. WSD's anneal (``anneal`` samples, ``anneal_style``) is no part of the state:
    Megatron-LM builds it from the flags."""
    return [rate for rate, _ in megatron_rates_and_decays(states, anneal, anneal_style)]


def megatron_rates_and_decays(
    states: list[dict], anneal: int | None = None, anneal_style: str | None = None
) -> list[tuple[float, float]]:
    """megatron_rates, with the weight decay (get_wd) the loaded scheduler gives beside each
    rate."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Stub:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    rates = []
    for saved in states:
        sched = OptimizerParamScheduler(
            Stub(), init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
            lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=10,
            wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True,
            wsd_decay_steps=anneal, lr_wsd_decay_style=anneal_style,
        )  # fmt: skip
        sched.load_state_dict(saved)
        rates.append((sched.get_lr(Stub.param_groups[0]), sched.get_wd()))
    return rates
