"""Context-parallel checks that run on every rank of a launched test (module level, so spawn
can import them)."""

from __future__ import annotations

import torch

import megart.distributed as dist
from megart.models.attention import Attention
from megart.models.config import GPTConfig
from megart.models.context_parallel import group_positions, split_for_cp
from megart.models.gpt import GPTChunk
from megart.models.hf import _gather
from megart.models.rope import rotary
from megart.tensor_parallel import sync_sequence_parallel_grads
from megart.tensor_parallel._group import group_rank, group_size

F64 = torch.float64
VOCAB_ROWS = {"wte.weight", "output_layer.weight"}  # a GPTChunk's (padded) vocabulary rows


def attention(cfg: GPTConfig, group: dist.ProcessGroup | None, seed: int) -> dict:
    """The attention of one layer on this rank's part of a seeded [s, b, h] input (rope at the
    tokens' global positions, as GPTChunk gives it): output, input gradient and weight
    gradients (partial sums over the context-parallel ranks) for a seeded output gradient."""
    cp, r = group_size(group), group_rank(group)
    gen = torch.Generator().manual_seed(seed)
    s, b, h = cfg.seq_length, 2, cfg.hidden_size
    x_all = torch.randn(s, b, h, generator=gen, dtype=F64)
    dy_all = torch.randn(s, b, h, generator=gen, dtype=F64)
    layer = Attention(cfg, 0, None, False, cp_group=group).to(F64)
    x = split_for_cp(x_all, 0, cp, r).requires_grad_()
    cos, sin = rotary(s, cfg.rotary_dim, x.device)
    rows = group_positions(group, s // cp, x.device)
    y = layer(x, (cos[rows].to(F64), sin[rows].to(F64)))
    (y * split_for_cp(dy_all, 0, cp, r)).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, "grads": grads}


def model(
    cfg: GPTConfig,
    group: dist.ProcessGroup | None,
    seed: int,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
) -> dict:
    """A whole one-chunk GPT on this rank's part of seeded token sequences: the loss averaged
    over the context-parallel ranks (each holds as many tokens) and the weight gradients of
    that mean (this rank's part summed over the group, divided by cp, as the trainer's
    averaging over dp x cp does). With ``tp_group`` the weights are split over it (and with
    ``sequence_parallel`` each rank's s/cp tokens too, over t, outside attention and the
    MLP); the gradients are then the whole ones, gathered over it (the sequence-parallel
    ones' partial sums completed first, as the trainer does)."""
    cp, r = group_size(group), group_rank(group)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                           generator=torch.Generator().manual_seed(seed))  # fmt: skip
    chunk = GPTChunk(cfg, range(cfg.num_layers), True, True, tp_group, sequence_parallel,
                     cp_group=group).to(F64)  # fmt: skip
    x, y = (split_for_cp(t, 1, cp, r) for t in (tokens[:, :-1], tokens[:, 1:]))
    loss = chunk.loss(chunk(x), y)
    loss.backward()
    sync_sequence_parallel_grads(chunk, tp_group)
    mean = loss.detach().clone()
    grads = {n: _whole(p, tp_group) for n, p in chunk.named_parameters()}
    for n in VOCAB_ROWS & grads.keys():  # the padding depends on t; the real rows must agree
        grads[n] = grads[n][: cfg.vocab_size]
    if group is not None:
        for t in (mean, *grads.values()):
            dist.all_reduce(t, op="avg", group=group)
    return {"loss": mean, "grads": grads}


def _whole(p: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``p``'s gradient, gathered over tensor parallelism when split over it."""
    shard = torch.nn.Parameter(p.grad.clone())
    if hasattr(p, "partition_dim"):
        shard.partition_dim = p.partition_dim
    return _gather(shard, tp_group).contiguous()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def cp2_and_cp4_groups() -> dict[int, dist.ProcessGroup]:
    """This rank's groups of 4 launched ranks by size: cp2 (ranks 0-1 or 2-3) and cp4."""
    rank, groups = dist.get_rank(), {}
    for size in (2, 4):
        for start in range(0, 4, size):
            g = dist.new_group(list(range(start, start + size)))
            if rank in g.ranks:
                groups[size] = g
    return groups


def against_one_process(cfg_kw: dict, model_kws: list[dict]) -> dict[str, float]:
    """On each of 4 ranks: one layer's attention (``cfg_kw``) at cp2 (two groups) and cp4, and
    whole models (each of ``model_kws``) at cp2 and cp4, against one process; the largest
    relative differences of outputs, input gradients and weight gradients."""
    dist.init(timeout=60)
    groups = cp2_and_cp4_groups()
    cfg = GPTConfig(**cfg_kw)
    want = attention(cfg, None, seed=7)
    worst = {}
    for size, g in groups.items():
        got = attention(cfg, g, seed=7)
        r = group_rank(g)
        worst[f"cp{size} attention y"] = _rel(got["y"], split_for_cp(want["y"], 0, size, r))
        worst[f"cp{size} attention dx"] = _rel(got["dx"], split_for_cp(want["dx"], 0, size, r))
        for name, grad in got["grads"].items():
            total = grad.clone()
            dist.all_reduce(total, group=g)  # each rank's weight gradient is its tokens' part
            worst[f"cp{size} attention d{name}"] = _rel(total, want["grads"][name])
    for i, kw in enumerate(model_kws):
        cfg = GPTConfig(**kw)
        want = model(cfg, None, seed=3)
        for size, g in groups.items():
            got = model(cfg, g, seed=3)
            worst[f"cp{size} model{i} loss"] = _rel(got["loss"], want["loss"])
            grads = [_rel(got["grads"][n], w) for n, w in want["grads"].items()]
            worst[f"cp{size} model{i} grads"] = max(grads)
    return worst


def tp_sp_against_one_process(model_kws: list[dict]) -> dict[str, float]:
    """On each of 4 ranks, tensor-parallel 2 (ranks 0-1, 2-3) x context-parallel 2 (ranks 0-2,
    1-3; Megatron's tp-cp order) with sequence parallelism: whole models (each of
    ``model_kws``) against one process; the largest relative differences of the loss and of
    the gradients, each gathered whole."""
    dist.init(timeout=60)
    rank = dist.get_rank()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, cp = tp_groups[rank // 2], cp_groups[rank % 2]
    worst = {}
    for i, kw in enumerate(model_kws):
        cfg = GPTConfig(**kw)
        want = model(cfg, None, seed=3)
        got = model(cfg, cp, seed=3, tp_group=tp, sequence_parallel=True)
        worst[f"tp2 cp2 sp model{i} loss"] = _rel(got["loss"], want["loss"])
        for n, w in want["grads"].items():
            worst[f"tp2 cp2 sp model{i} d{n}"] = _rel(got["grads"][n], w)
    return worst


def losses(kw: dict) -> list[float]:
    """The loss of each iteration of the tiny run (train_workers.tiny) on this rank."""
    import train_workers as tw

    return [h["loss"] for h in tw.train(**kw)]
