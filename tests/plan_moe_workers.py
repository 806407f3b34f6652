"""One mixture-of-experts layer (megart.models.moe) split over two launched tensor-parallel
ranks with sequence parallelism, for tests/test_plan_moe_time.py: the collectives it runs in a
forward and a backward (kind and the whole buffer's bytes, as plan.moe_time counts them) and
torch's FLOP count of its forward products."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from torch.utils.flop_counter import FlopCounterMode

import megart.distributed as dist
from megart.models.config import GPTConfig
from megart.models.moe import AuxLossScale, MoE

TP = 2


@contextlib.contextmanager
def _recorded(calls: list[tuple[str, int]]) -> Iterator[None]:
    """Records each collective megart.distributed runs: (collectives.BUS_FACTOR's kind, the bytes
    of the whole buffer: a gather's output, a reduce-scatter's input, an all-reduce's)."""
    gather, scatter, reduce = (
        dist.all_gather_into_tensor,
        dist.reduce_scatter_tensor,
        dist.all_reduce,
    )

    def all_gather(out: torch.Tensor, inp: torch.Tensor, *a: object, **k: object) -> object:
        calls.append(("all_gather", out.nbytes))
        return gather(out, inp, *a, **k)

    def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, *a: object, **k: object) -> object:
        calls.append(("reduce_scatter", inp.nbytes))
        return scatter(out, inp, *a, **k)

    def all_reduce(t: torch.Tensor, *a: object, **k: object) -> object:
        calls.append(("all_reduce", t.nbytes))
        return reduce(t, *a, **k)

    with (
        mock.patch.object(dist, "all_gather_into_tensor", all_gather),
        mock.patch.object(dist, "reduce_scatter_tensor", reduce_scatter),
        mock.patch.object(dist, "all_reduce", all_reduce),
    ):
        yield


def _one(kw: dict, tokens: int, batch: int, bf16: bool, group: dist.ProcessGroup) -> dict:
    cfg = GPTConfig(**kw)
    layer = MoE(cfg, 0, AuxLossScale(), group, sequence_parallel=True)
    torch.manual_seed(1)  # the same whole sequence on both ranks: each takes its slice
    whole = torch.randn(tokens, batch, cfg.hidden_size)
    x = whole.chunk(TP)[dist.get_rank(group)].clone().requires_grad_()
    forward: list[tuple[str, int]] = []
    backward: list[tuple[str, int]] = []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with _recorded(forward), FlopCounterMode(display=False) as flops, autocast:
        y = layer(x)
    with _recorded(backward):
        y.float().square().sum().backward()
    return {"forward": forward, "backward": backward, "flops": flops.get_total_flops()}


def collectives_and_flops(cases: list[tuple[dict, int, int, bool]]) -> list[dict]:
    """_one of each case (GPTConfig fields, sequence length, batch, autocast to bf16) on this
    rank."""
    return each_case(_one, cases)


def each_case(one: Callable[..., dict], cases: list[tuple]) -> list[dict]:
    """``one(*case, group)`` of each case on this rank, ``group`` the TP ranks' (launched)."""
    dist.init(timeout=120)
    group = dist.new_group(list(range(TP)))
    try:
        return [one(*case, group) for case in cases]
    finally:
        dist.destroy()
