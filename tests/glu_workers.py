"""Launched workers for tests/test_quick_geglu.py: sink_workers' comparison with Megatron-Core
(logits and every gradient) run with a mistake planted in megart's quick GeGLU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

import sink_workers as sw
from megart.models.mlp import MLP

_RIGHT = MLP.act


def _wrong(kind: str):
    """MLP.act with ``kind``'s mistake: "offset-on-gate" (the offset added to the gate, not
    to the linear half), "no-clamp", "clamp-gate-both-sides" (the gate also clamped below)."""

    def act(self, up: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        c = self.clamp
        if kind == "offset-on-gate":
            gate = gate.clamp(max=c) + self.glu_offset
            return gate * torch.sigmoid(1.702 * gate) * up.clamp(-c, c)
        if kind == "no-clamp":
            return gate * torch.sigmoid(1.702 * gate) * (up + self.glu_offset)
        gate, up = gate.clamp(-c, c), up.clamp(-c, c)
        return gate * torch.sigmoid(1.702 * gate) * (up + self.glu_offset)

    return act


@contextlib.contextmanager
def planted(mistake: str | None) -> Iterator[None]:
    with mock.patch.object(MLP, "act", _wrong(mistake)) if mistake else contextlib.nullcontext():
        yield


def against_megatron_core(kw: dict, mistake: str | None = None) -> dict[str, float]:
    """sink_workers.against_megatron_core (on each launched rank) with ``mistake`` planted."""
    with planted(mistake):
        return sw.against_megatron_core(kw)
