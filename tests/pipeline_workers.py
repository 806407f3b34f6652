"""A toy model split into pipeline stages, run by the engine on every rank, and the same model
in one process as the reference."""

from __future__ import annotations

import time

import torch
from torch import nn

import megart.distributed as dist
from megart import schedule as sched
from megart.pipeline import PipelineEngine, StageLink
from megart.tensor_parallel.weight_grad import linear

HIDDEN, BATCH, LAYERS = 8, 4, 8


class Linear(nn.Linear):
    """nn.Linear through megart's linear, whose weight gradient a zero-bubble W computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def full_model() -> nn.ModuleList:
    torch.manual_seed(1234)
    return nn.ModuleList(
        nn.Sequential(Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(LAYERS)
    ).double()


def data(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    xs = [torch.randn(BATCH, HIDDEN, generator=g, dtype=torch.float64) for _ in range(m)]
    ys = [torch.randn(BATCH, HIDDEN, generator=g, dtype=torch.float64) for _ in range(m)]
    return xs, ys


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def reference(m: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = full_model()
    xs, ys = data(m)
    losses = []
    for x, y in zip(xs, ys, strict=True):
        h = x
        for layer in model:
            h = layer(h)
        loss = loss_fn(h, y)
        (loss / m).backward()
        losses.append(loss.item())
    return losses, {n: p.grad for n, p in model.named_parameters()}


def run_stage(kind: str, p: int, m: int, v: int, tp: int, scatter_gather: bool):
    """World = p x tp ranks, tensor-parallel ranks adjacent. The toy model is replicated across
    tensor parallel (each tp rank computes the same), so scatter/gather applies."""
    dist.init(backend="shm", timeout=60)
    rank = dist.get_rank()
    tp_groups = [dist.new_group([s * tp + t for t in range(tp)]) for s in range(p)]
    pp_groups = [dist.new_group([s * tp + t for s in range(p)]) for t in range(tp)]
    stage, tp_rank = divmod(rank, tp)
    link = StageLink(pp_groups[tp_rank], tp_groups[stage] if tp > 1 else None, scatter_gather)

    s = sched.build(kind, p, m, v)
    model = full_model()
    per_chunk = LAYERS // (p * v)
    layer_ids = [
        list(range(vs * per_chunk, (vs + 1) * per_chunk))
        for vs in (s.virtual_stage(stage, c) for c in range(v))
    ]
    chunks = [nn.Sequential(*(model[i] for i in ids)) for ids in layer_ids]
    engine = PipelineEngine(s, stage, chunks, link, (BATCH, HIDDEN), torch.float64)
    xs, ys = data(m)
    dist.reset_bytes_sent(link.pp_group)
    start = time.perf_counter()
    losses = engine.run(xs, ys, loss_fn)
    # The engine's compute clock (read by bench/pipeline_bubble.py) counts part of the run.
    assert 0 < engine.last_compute_time < time.perf_counter() - start
    # A split backward leaves every linear layer's weight gradient of every microbatch to W.
    split = kind.startswith("zb")
    assert engine.last_deferred_weight_grads == (m * sum(map(len, layer_ids)) if split else 0)
    grads = {
        f"{i}.{n}": q.grad for ids in layer_ids for i in ids for n, q in model[i].named_parameters()
    }
    sent = sum(dist.bytes_sent(link.pp_group).values())
    return [x.item() for x in losses], grads, sent


def data_parallel_grads(m: int, bucket_bytes: int):
    """Each of the dp ranks runs m microbatches of its own share of the data; returns the
    averaged gradients and how many buckets they travelled in."""
    from megart.training.grad_sync import GradientBuckets

    dist.init(timeout=60)
    rank, dp = dist.get_rank(), dist.get_world_size()
    model = full_model()
    buckets = GradientBuckets(list(model.parameters()), dist.new_group(), bucket_bytes)
    _backward_own_share(model, buckets, rank, m, dp)
    buckets.finish()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(buckets.buckets)


def bf16_wire_buckets(shard: bool) -> dict:
    """Two microbatches of this rank's data through GradientBuckets with reduce_dtype bf16
    (reduced after backward, so each buffer still holds this rank's own mean until finish):
    per bucket the buffer before and after, this rank's slice of it, and the dtypes that went
    over the wire."""
    from megart.training.grad_sync import GradientBuckets

    dist.init(timeout=60)
    rank, m = dist.get_rank(), 2
    model = full_model()
    buckets = GradientBuckets(list(model.parameters()), dist.new_group(), 700, overlap=False,
                              shard=shard, reduce_dtype=torch.bfloat16)  # fmt: skip
    wire = []
    for name in ("all_reduce", "reduce_scatter_tensor"):
        real = getattr(dist, name)

        def recording(tensor, *args, _real=real, **kw):
            wire.append(tensor.dtype)
            return _real(tensor, *args, **kw)

        setattr(dist, name, recording)
    _backward_own_share(model, buckets, rank, m, dist.get_world_size())
    before = [b.buffer.clone() for b in buckets.buckets]
    buckets.finish()
    return dict(
        before=before,
        after=[b.buffer.clone() for b in buckets.buckets],
        ranges=[buckets.shard_range(b) for b in buckets.buckets],
        wire=wire,
    )


def _backward_own_share(model: nn.ModuleList, buckets, rank: int, m: int, dp: int) -> None:
    """Backward of this rank's m microbatches of the m x dp, each loss divided by m."""
    xs, ys = data(m * dp)
    buckets.zero_grad()
    buckets.start_iteration(m)
    for x, y in zip(xs[rank * m : (rank + 1) * m], ys[rank * m : (rank + 1) * m], strict=True):
        h = x
        for layer in model:
            h = layer(h)
        (loss_fn(h, y) / m).backward()
