"""megart train ranks under expert parallelism with the routing prescribed, for
tests/test_plan_moe_ep.py: what a rank holds (plan_workers.held_bytes) and the all-to-alls its
MoE layers post in a training step, when every token's k experts are chosen by a rule instead
of by its logits, so that the token copies each rank's experts get are known.

The rule adds a constant to the chosen experts' logits before megart's own routing
(models.moe.route) picks them: its top-k, softmax and scatter then run and save as they do for
any routing (a constant has no gradient and saves nothing), and the softmax over the chosen
logits is the same function of them. The losses read the unshifted logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

import megart.distributed as dist
import megart.models.moe as moe
from plan_workers import held_bytes

SHIFT = 100.0  # above any logit's spread at these sizes, bf16 included


def _chosen(tokens: int, experts: int, k: int, routing: str) -> torch.Tensor:
    """[tokens, k] experts: "balanced", copy j of token i to expert (i k + j) mod E (each
    expert k T / E of any T that E divides), "first" every token to experts 0..k-1 (all on
    expert-parallel rank 0 where k <= E / ep)."""
    if routing == "balanced":
        return (torch.arange(tokens).unsqueeze(1) * k + torch.arange(k)) % experts
    return torch.arange(k).expand(tokens, k)


@contextlib.contextmanager
def prescribed(routing: str) -> Iterator[None]:
    """megart's routing with the experts ``_chosen`` picks."""
    route = moe.route

    def shifted(
        logits: torch.Tensor, cfg: object, *bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, e = logits.shape
        shift = torch.zeros(t, e, dtype=logits.dtype, device=logits.device)
        shift.scatter_(1, _chosen(t, e, cfg.moe_router_topk, routing), SHIFT)
        return route(logits + shift, cfg, *bias)  # the expert bias, where moe passes one

    with mock.patch.object(moe, "route", shifted):
        yield


def routed_held_bytes(kw: dict, routing: str) -> dict:
    """plan_workers.held_bytes with the routing prescribed."""
    with prescribed(routing):
        return held_bytes(kw)


def routed_exchanges(kw: dict, routing: str) -> list[int]:
    """The bytes of each send buffer megart.distributed.all_to_all posts (all its pieces, this
    rank's own included) in the second training step, the routing prescribed."""
    from megart.training.config import TrainConfig
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    sent: list[int] = []
    real = dist.all_to_all

    def recorded(received: list, pieces: list, group: object) -> object:
        sent.append(sum(p.nbytes for p in pieces))
        return real(received, pieces, group)

    with prescribed(routing):
        trainer = Trainer(TrainConfig(**kw), tokens=builtin_corpus(1 << 16))
        trainer.train_step(0)
        with mock.patch.object(dist, "all_to_all", recorded):
            trainer.train_step(1)
    return sent
