"""megart's mixture-of-experts GPT split over two tensor-parallel ranks (sequence parallelism
on) next to Megatron-Core's GPTModel built the same way (local spec, SequentialMLP experts split
over the expert tensor-parallel group, the allgather dispatcher, CPU, float64), each holding its
own rank's pieces of one set of weights: the logits, and the gradients of one training step
with the load-balancing loss and the z-loss. Run on two launched processes, which share
torch.distributed's default group (megart.distributed's torch backend) with Megatron-Core."""

from __future__ import annotations

import re
from unittest import mock

import torch

import megart.distributed as dist
from megart.models import GPT, GPTConfig, moe
from megart.models.hf import _gather
from megart.models.megatron_names import from_megatron, to_megatron
from megart.models.vocab import fit_vocab
from megart.tensor_parallel import sync_sequence_parallel_grads
from megart.tensor_parallel._group import group_rank
from megart.training.megatron_layout import shard, tp_dim, unshard
from megatron_core_workers import drawn, megatron_model, on_cpu_only
from moe_workers import gate_mistake, lm_loss

TP = 2
VOCAB_ROWS = ("wte.weight", "output_layer.weight")


def _ours(
    whole: dict, cfg: GPTConfig, group: dist.ProcessGroup, ep_group: dist.ProcessGroup = None
) -> GPT:
    """megart's GPT at TP with sequence parallelism (and its experts spread over ``ep_group``
    where given), holding this rank's pieces of ``whole`` (its one-process weights) by each
    parameter's partition_dim."""
    model = GPT(cfg, tp_group=group, sequence_parallel=True, ep_group=ep_group).double()
    rank, rows = group_rank(group), cfg.padded_vocab_size(TP)
    with torch.no_grad():
        for name, p in model.chunk.named_parameters():
            value = fit_vocab(whole[name], rows) if name in VOCAB_ROWS else whole[name]
            dim = getattr(p, "partition_dim", None)
            p.copy_(value if dim is None else value.chunk(TP, dim)[rank])
    return model


def _theirs(whole: dict, cfg: GPTConfig, rank: int) -> torch.nn.Module:
    """Megatron-Core's GPTModel at TP with --sequence-parallel, strictly loading this rank's
    pieces of ``whole`` as Megatron-LM's legacy checkpoint splits them (megatron_layout)."""
    model = megatron_model(cfg, TP, sequence_parallel=True)
    names = to_megatron({k: v.clone() for k, v in whole.items()}, cfg)
    state = {}
    for name, value in names.items():
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            value = fit_vocab(value, cfg.padded_vocab_size(TP))
        state[name] = shard(name, value, cfg, TP, rank)
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    model.load_state_dict({**state, **extra}, strict=True)
    return model


def _their_grads(
    model: torch.nn.Module, cfg: GPTConfig, group: dist.ProcessGroup, first_expert: int = 0
) -> dict:
    """Megatron-Core's whole gradients in megart's names: its sequence-parallel parameters'
    (norms, the router) completed over the group as its finalize_model_grads does, the split
    ones gathered and merged as megatron_layout merges a checkpoint's (its local experts
    renumbered from ``first_expert``, under expert parallelism)."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    whole = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "sequence_parallel", False):
            torch.distributed.all_reduce(g, group=tp_group)
        if tp_dim(name) is not None:
            parts = [torch.empty_like(g) for _ in range(TP)]
            torch.distributed.all_gather(parts, g.contiguous(), group=tp_group)
            g = unshard(name, parts, cfg)
        whole[name] = g
    return from_megatron(renumbered_experts(whole, first_expert), cfg)


_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)\.")


def renumbered_experts(names: dict, offset: int) -> dict:
    """``names`` (Megatron-Core's) with each expert index moved by ``offset`` (global to
    local and back, under expert parallelism)."""
    return {_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + offset}.", k): v for k, v in names.items()}


def _our_grads(model: GPT, group: dist.ProcessGroup, unsummed: str | None) -> dict:
    """megart's whole gradients: the sequence-parallel ones completed as the trainer does
    (but those of parameters named ending in ``unsummed``, left out: a mistake to catch), the
    split ones gathered."""
    left_out = [p for n, p in model.chunk.named_parameters() if unsummed and n.endswith(unsummed)]
    for p in left_out:
        p.sequence_parallel = False
    sync_sequence_parallel_grads(model, group)
    return {n: _gather(_grad(p), group) for n, p in model.chunk.named_parameters()}


def _grad(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """``p``'s gradient, split as ``p`` is (for hf._gather)."""
    grad = torch.nn.Parameter(p.grad.detach().clone())
    if hasattr(p, "partition_dim"):
        grad.partition_dim = p.partition_dim
    return grad


def compare(kw: dict, factor: float, group: dist.ProcessGroup, mistake: str | None) -> dict:
    """One model: the largest logit difference of megart's tp2 model from Megatron-Core's and
    from megart's one process, then one training step of both tp2 models (loss times
    ``factor``, the auxiliary losses' gradients scaled by it): the largest gradient difference
    over all parameters and over the routers', relative to the largest gradient. ``mistake``
    makes megart's step wrong on purpose: "aux-local" (the load-balancing loss without the
    counts summed over the group), "router-unsummed" (the router's gradient not completed over
    the group), "z-undivided" (the z-loss coefficient not divided by t), "gate-unsummed" (the
    shared-expert gate's gradient not completed), or moe_workers.gate_mistake's (the logits
    too)."""

    cfg = GPTConfig(**kw)
    rank = group_rank(group)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    one = drawn(GPT(cfg).double())
    whole = {k: v.detach().clone() for k, v in one.chunk.state_dict().items()}
    ours, theirs = _ours(whole, cfg, group), _theirs(whole, cfg, rank)

    s, v = cfg.seq_length, cfg.vocab_size
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    ours.eval(), theirs.eval(), one.eval()
    with torch.no_grad(), _mistaken(mistake):
        want = one(tokens)[..., :v]
        got = ours(tokens)[..., :v]
        local = theirs(tokens, positions, mask).contiguous()
        parts = [torch.empty_like(local) for _ in range(TP)]
        torch.distributed.all_gather(parts, local)
        megatron = torch.cat(parts, -1)[..., :v]

    backward_both(ours, theirs, (tokens, labels, positions, mask), factor, _mistaken(mistake))

    want_grads = _their_grads(theirs, cfg, group)
    unsummed = {"router-unsummed": "router.weight", "gate-unsummed": "shared_expert_gate.weight"}
    got_grads = _our_grads(ours, group, unsummed.get(mistake or ""))
    figures, diff = compared((got, want, megatron), want_grads, got_grads, v)
    return dict(figures, router=max(d for n, d in diff.items() if n.endswith("router.weight")))


def backward_both(
    ours: GPT, theirs: torch.nn.Module, batch: tuple, factor: float, mistaken: object
) -> None:
    """One training step's backward of both models on ``batch`` (tokens, labels, positions,
    mask), the loss times ``factor`` and the auxiliary losses' gradients scaled by it; megart's
    inside the context manager ``mistaken``."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    tokens, labels, positions, mask = batch
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(factor, dtype=torch.float64))
    theirs.train()
    # Its logits gathered over the vocabulary shards (backward: each rank's slice), the loss
    # as moe_workers takes it (its own loss from labels would count the vocabulary padding's
    # zero logits, which megart's leaves out).
    logits = gather_from_tensor_model_parallel_region(theirs(tokens, positions, mask))
    (lm_loss(logits, labels, ours.cfg.vocab_size) * factor).backward()
    ours.train()
    ours.chunk.set_loss_scale(factor)
    with mistaken:
        (ours(tokens, labels) * factor).backward()


def compared(logits: tuple, want: dict, got: dict, vocab: int) -> tuple[dict, dict]:
    """The figures both comparisons report: megart's ``logits`` (ours, one process's,
    Megatron-Core's) apart, the largest gradient (``want``'s: Megatron-Core's) and the largest
    difference of ``got``'s from it relative to that; and that difference by name. The
    vocabulary padding, which depends on t, is cut off first."""
    ours, one, megatron = logits
    for name in VOCAB_ROWS:
        for grads in (want, got):
            if name in grads:
                grads[name] = grads[name][:vocab]
    assert set(want) == set(got), set(want) ^ set(got)
    top = max(w.abs().max().item() for w in want.values())
    diff = {n: (got[n] - w).abs().max().item() / top for n, w in want.items()}
    figures = dict(
        megatron_logits=(ours - megatron).abs().max().item(),
        one_process_logits=(ours - one).abs().max().item(),
        scale=one.abs().max().item(),
        largest=max(diff.values()),
        gate=max([d for n, d in diff.items() if "shared_expert_gate" in n], default=None),
        top=top,
    )
    return figures, diff


def _mistaken(mistake: str | None) -> mock._patch | mock.MagicMock:
    """A patch of megart's MoE layer that makes ``mistake`` (see compare), or nothing."""
    if mistake == "aux-local":
        real = moe.load_balancing_loss

        def local(x: torch.Tensor, c: GPTConfig, g: object = None, cp: object = None) -> object:
            return real(x, c)  # the counts of this rank's tokens only

        return mock.patch.object(moe, "load_balancing_loss", local)
    if mistake == "z-undivided":
        real_z = moe.z_loss
        return mock.patch.object(moe, "z_loss", lambda x, c: real_z(x, c * TP))
    return gate_mistake(mistake)  # a shared-expert gate's mistake, or nothing


def compare_all(cases: list[tuple]) -> list[dict]:
    """compare of each case (kw, factor, mistake) on each of the TP launched ranks, in one
    torch.distributed world shared by megart and Megatron-Core."""
    from megatron.core import parallel_state

    dist.init("torch", timeout=120)
    parallel_state.initialize_model_parallel(TP, 1)
    on_cpu_only()
    group = dist.new_group(list(range(TP)))
    try:
        return [compare(kw, factor, group, mistake) for kw, factor, mistake in cases]
    finally:
        dist.destroy()
