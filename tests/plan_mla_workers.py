"""One multi-latent attention (megart.models.mla) split over two launched tensor-parallel ranks,
for tests/test_plan_mla_time.py: the collectives it runs in a forward and a backward (kind and
the whole buffer's bytes, as plan.mla_time counts them)."""

from __future__ import annotations

import torch

import megart.distributed as dist
from megart.models.config import GPTConfig
from megart.models.mla import MLA
from megart.models.rope import rotary
from plan_moe_workers import TP, _recorded, each_case


def _one(kw: dict, tokens: int, batch: int, sp: bool, group: dist.ProcessGroup) -> dict:
    cfg = GPTConfig(**kw)
    layer = MLA(cfg, 0, group, sp)
    torch.manual_seed(1)  # the same whole sequence on both ranks: each takes its slice
    whole = torch.randn(tokens, batch, cfg.hidden_size)
    x = whole.chunk(TP)[dist.get_rank(group)] if sp else whole
    x = x.clone().requires_grad_()
    rope = rotary(tokens, cfg.rotary_dim, x.device)
    forward: list[tuple[str, int]] = []
    backward: list[tuple[str, int]] = []
    with _recorded(forward):
        y = layer(x, rope)
    with _recorded(backward):
        y.square().sum().backward()
    return {"forward": forward, "backward": backward}


def collectives(cases: list[tuple[dict, int, int, bool]]) -> list[dict]:
    """_one of each case (GPTConfig fields, sequence length, batch, sequence parallelism) on
    this rank."""
    return each_case(_one, cases)
