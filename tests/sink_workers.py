"""Launched workers of test_attention_sinks.py: megart's attention sinks (--softmax-type) against
Megatron-Core 0.16.1's GPTModel (float64, CPU) at tensor-parallel sizes 1 and 2, against one
process under context parallelism, and with mistakes planted."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch

import cp_workers as cw
import megart.distributed as dist
import megatron_core_workers as mcw
from megart.models import GPT, GPTConfig, attention, ring_attention
from megart.models.context_parallel import split_for_cp
from megart.models.megatron_names import from_megatron, to_megatron
from megart.models.vocab import fit_vocab
from megart.training.shards import partition_dims

F64 = torch.float64


@contextlib.contextmanager
def planted(mistake: str | None) -> Iterator[None]:
    """megart with ``mistake``: "vanilla" (no sink at all), "twice" (the ring's log-sum-exp
    starts at the sink counted twice, logaddexp(sink, sink)), "unsharded" (every
    tensor-parallel rank holds the first heads' sinks, not its own heads')."""
    real_lse, real_make, real_logits = ring_attention.initial_lse, attention.make_sink, None
    if mistake == "twice":
        ring_attention.initial_lse = lambda sink, *a: real_lse(
            None if sink is None else sink + math.log(2), *a
        )
    elif mistake == "unsharded":

        def first_heads(cfg, layer, tp_group):
            p = real_make(cfg, layer, None)
            if p is None:
                return None
            part = torch.nn.Parameter(p.detach()[: cfg.num_attention_heads // dist_size(tp_group)])
            part.partition_dim = 0
            return part

        attention.make_sink = first_heads
    elif mistake == "vanilla":
        real_logits = attention.sink_logits
        attention.sink_logits = lambda *a: None
    try:
        yield
    finally:
        ring_attention.initial_lse, attention.make_sink = real_lse, real_make
        if real_logits is not None:
            attention.sink_logits = real_logits


def dist_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else group.size()


def _loss_weights(cfg: GPTConfig, padded: int) -> torch.Tensor:
    """Seeded weights of each logit in the loss (0 on the vocabulary's padding)."""
    g = torch.Generator().manual_seed(17)
    w = torch.randn(2, cfg.seq_length, cfg.vocab_size, generator=g, dtype=F64)
    return torch.cat([w, w.new_zeros(*w.shape[:2], padded - cfg.vocab_size)], -1)


def against_megatron_core(kw: dict, mistake: str | None = None) -> dict[str, float]:
    """On each launched rank (tensor-parallel size: the world's): megart's one-process float64
    GPT of ``kw`` (weights drawn), and Megatron-Core's GPTModel loading this rank's slices of
    its weights; the largest differences of the logits and of each parameter's gradient (of
    a seeded weighted sum of the logits), relative to the largest value; with a ``mistake``
    planted in megart (see planted)."""
    tp, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    from megatron.core import parallel_state

    if tp > 1:
        torch.distributed.init_process_group("gloo")
        parallel_state.initialize_model_parallel(tp, 1)
        mcw.on_cpu_only()
    cfg = GPTConfig(**kw)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    with planted(mistake):
        ours = mcw.drawn(GPT(cfg).double())
        want = ours(tokens)
    padded = cfg.padded_vocab_size(tp)
    weights = _loss_weights(cfg, padded)
    (want * weights[..., : want.shape[-1]]).sum().backward()
    theirs = mcw.megatron_model(cfg, tp)
    dims = partition_dims(cfg, tuple(range(cfg.num_layers)), True, True)
    whole = ours.chunk.state_dict()
    grads = {n.removeprefix("chunk."): p.grad for n, p in ours.named_parameters()}
    mine, my_grads = {}, {}
    for name, value in whole.items():
        grad = grads[name] if grads[name] is not None else torch.zeros_like(value)  # unused
        if name in ("wte.weight", "output_layer.weight"):
            value, grad = fit_vocab(value, padded), fit_vocab(grad, padded)
        dim = dims[name]
        mine[name] = value if dim is None else value.chunk(tp, dim)[rank]
        my_grads[name] = grad if dim is None else grad.chunk(tp, dim)[rank]
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith("_extra_state")}
    theirs.load_state_dict({**to_megatron(mine, cfg), **extra}, strict=True)
    s = tokens.shape[1]
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    local = theirs(tokens, positions, torch.ones(1, 1, s, s, dtype=torch.bool).triu(1))
    (local * weights.chunk(tp, -1)[rank]).sum().backward()
    parts = [torch.empty_like(local) for _ in range(tp)]
    if tp > 1:
        torch.distributed.all_gather(parts, local.detach().contiguous())
    else:
        parts = [local.detach()]
    got = torch.cat(parts, -1)[..., : want.shape[-1]]
    scale = want.abs().max().item()
    out = {"logits": (got - want.detach()).abs().max().item() / scale}
    their_grads = from_megatron(
        {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}, cfg
    )
    assert set(their_grads) == set(my_grads), set(their_grads) ^ set(my_grads)
    for name, g in my_grads.items():
        out["d" + name] = ((their_grads[name] - g).abs().max() / g.abs().max()).item()
    if tp > 1:
        torch.distributed.destroy_process_group()
    return out


def reference(q, k, v, sink, dy, window=None):
    """One process, float64, written out: softmax of each row's causal scores (within
    ``window`` earlier tokens) and its sink's logit, the sink's share dropped; the output
    and the gradients of q, k, v and the sink for ``dy``."""
    q, k, v, sink = (t.detach().clone().requires_grad_() for t in (q, k, v, sink))
    n = q.shape[2]
    i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    seen = (j <= i) & ((j >= i - window) if window is not None else True)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~seen, -math.inf)
    logit = sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    y = torch.softmax(torch.cat([scores, logit], -1), -1)[..., :-1] @ v
    (y * dy).sum().backward()
    return y.detach(), q.grad, k.grad, v.grad, sink.grad


def ring_against_reference(window: int | None, mistake: str | None = None) -> float:
    """On each rank of the launched context-parallel group: the ring with a sink (each step's
    block by the flash kernels and by explicit products) against one process's reference;
    the largest difference of outputs and gradients relative to the largest value."""
    dist.init(timeout=60)
    group = dist.new_group(list(range(dist.get_world_size())))
    cp, r = group.size(), group.rank()
    g = torch.Generator().manual_seed(5)
    q, k, v, dy = (torch.randn(2, 4, 8 * cp, 8, generator=g, dtype=F64) for _ in range(4))
    sink = torch.randn(4, generator=g, dtype=F64)
    want = reference(q, k, v, sink, dy, window)
    worst = 0.0
    for blocks in ("flash", "explicit"):
        mine = [split_for_cp(t, 2, cp, r).requires_grad_() for t in (q, k, v)]
        my_sink = sink.clone().requires_grad_()
        with planted(mistake):
            y = ring_attention.ring_attention(*mine, group, blocks=blocks, window=window,
                                              sink=my_sink)  # fmt: skip
        (y * split_for_cp(dy, 2, cp, r)).sum().backward()
        dsink = my_sink.grad.clone()
        dist.all_reduce(dsink, group=group)  # each rank's rows' part
        got = [y.detach(), *(t.grad for t in mine), dsink]
        wanted = [split_for_cp(x, 2, cp, r) for x in want[:4]] + [want[4]]
        for a, w in zip(got, wanted, strict=True):
            worst = max(worst, ((a - w).abs().max() / w.abs().max()).item())
    return worst


def cp_against_one_process(attention_kw: dict, model_kws: list[dict], mistake=None) -> dict:
    """cp_workers.against_one_process (one layer at cp2 and cp4, whole models) with a
    ``mistake`` planted (see planted)."""
    with planted(mistake):
        return cw.against_one_process(attention_kw, model_kws)


def tp2_against_one_process(kw: dict, mistake: str | None = None) -> dict[str, float]:
    """On each of 2 ranks: a whole float64 GPT of ``kw`` at tensor-parallel size 2 (weights
    from the same seeds as one process's) against one process: the loss and every gradient
    gathered whole, as relative differences; with a ``mistake`` planted."""
    dist.init(timeout=60)
    tp = dist.new_group([0, 1])
    cfg = GPTConfig(**kw)
    with planted(mistake):
        want = cw.model(cfg, None, seed=3)
        got = cw.model(cfg, None, seed=3, tp_group=tp, sequence_parallel=True)
    out = {"loss": cw._rel(got["loss"], want["loss"])}
    for n, w in want["grads"].items():
        out["d" + n] = cw._rel(got["grads"][n], w)
    return out
