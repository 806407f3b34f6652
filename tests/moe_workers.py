"""megart's mixture-of-experts GPT next to Megatron-Core's (local spec, SequentialMLP experts,
the allgather dispatcher, CPU, float64): the gradients of one training step, with the
load-balancing loss and the z-loss, under a loss factor such as a pipeline run's 1/m. Run in a
launched process, as megatron_core_workers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megart.models import GPT, GPTConfig
from megart.models.megatron_names import from_megatron, to_megatron
from megatron_core_workers import drawn, megatron_model


def _loss(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(logits[..., :vocab].reshape(-1, vocab), labels.reshape(-1))


def gradients(kw: dict, factor: float = 0.5, ours_factor: float | None = None) -> dict:
    """One step of both models on the same weights, each loss times ``factor``, Megatron-Core's
    auxiliary losses scaled by it (MoEAuxLossAutoScaler.set_loss_scale, as its schedules set
    loss scale / m) and megart's by ``ours_factor`` (default the same; GPTChunk.set_loss_scale,
    as megart's engine sets it). Returns the largest gradient difference over all parameters
    relative to the largest gradient, and the router weights' alone."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    cfg = GPTConfig(**kw)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    ours = drawn(GPT(cfg).double())
    theirs = megatron_model(cfg)
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith("_extra_state")}
    theirs.load_state_dict({**to_megatron(ours.state_dict(), cfg), **extra}, strict=True)

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(factor, dtype=torch.float64))
    s = cfg.seq_length
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    theirs.train()
    (_loss(theirs(tokens, positions, mask), labels, cfg.vocab_size) * factor).backward()

    ours.train()
    ours.chunk.set_loss_scale(factor if ours_factor is None else ours_factor)
    (_loss(ours(tokens), labels, cfg.vocab_size) * factor).backward()

    want = from_megatron({n: p.grad for n, p in theirs.named_parameters()}, cfg)
    got = {n: p.grad for n, p in ours.chunk.named_parameters()}
    assert set(want) == set(got), set(want) ^ set(got)
    top = max(w.abs().max().item() for w in want.values())
    diff = {n: (got[n] - want[n]).abs().max().item() / top for n in want}
    routers = [d for n, d in diff.items() if n.endswith("mlp.router.weight")]
    return dict(largest=max(diff.values()), router=max(routers), top=top)


def gradients_all(cases: list[tuple[dict, float, float | None]]) -> list[dict]:
    return [gradients(kw, factor, ours) for kw, factor, ours in cases]
