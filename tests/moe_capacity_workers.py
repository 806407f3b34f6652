"""Token dropping (--moe-expert-capacity-factor) next to Megatron-Core's own MoE model: each
layer's routing map after dropping, the logits and one step's gradients; and megart train runs
whose routers drop over other groups of tokens on purpose. Run in launched processes, as
megatron_core_workers."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

import moe_workers as mw
from megart.models import GPT, GPTConfig
from megart.models.megatron_names import to_megatron
from megatron_core_workers import drawn, megatron_model


class _StableTopk:
    """torch, but topk of an integer tensor takes tied values in index order (a stable sort):
    how Megatron-Core's position policy is documented to drop (the latest tokens), where
    torch.topk on the CPU returns ties in no such order."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        if x.is_floating_point():
            return torch.topk(x, k, dim=dim, largest=largest, sorted=sorted)
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def stable_ties(on: bool) -> contextlib.AbstractContextManager:
    """Megatron-Core's MoE utilities with _StableTopk for torch where ``on``."""
    from megatron.core.transformer.moe import moe_utils

    return mock.patch.object(moe_utils, "torch", _StableTopk()) if on else contextlib.nullcontext()


DROPLESS = dict(
    moe_expert_capacity_factor=None,
    moe_pad_expert_input_to_capacity=False,
    moe_token_drop_policy="probs",
)


@contextlib.contextmanager
def megart_routing() -> Iterator[list]:
    """megart's MoE layers' (probs, chosen) after dropping and the plain top k's chosen, per
    layer call, appended to the list yielded."""
    from megart.models import moe

    seen: list = []
    real = moe.route

    def route(logits: torch.Tensor, cfg: GPTConfig, bias: Any = None) -> tuple:
        probs, chosen = real(logits, cfg, bias)
        undropped = dataclasses.replace(cfg, **DROPLESS)
        plain = real(logits, undropped, bias)[1]
        seen.append((probs.detach(), chosen, plain))
        return probs, chosen

    with mock.patch.object(moe, "route", route):
        yield seen


def routing(kw: dict, stable: bool, ours_kw: dict | None = None) -> dict:
    """One forward of both models on the same weights and tokens (Megatron-Core's position
    ties in order where ``stable``; ``ours_kw`` changes megart's model): each MoE layer's maps
    equal, the copies megart dropped (the plain top k's less those kept), the most and fewest
    tokens any expert took, and the logits' largest difference relative to their largest."""
    cfg = GPTConfig(**kw)
    tokens = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(3)
    )
    ours = drawn(GPT(cfg).double()).eval()
    if ours_kw:  # the same weights
        changed = GPT(GPTConfig(**{**kw, **ours_kw})).double().eval()
        changed.load_state_dict(ours.state_dict())
        ours = changed
    theirs = megatron_model(cfg).eval()
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith(mw.MEGATRON_ONLY)}
    theirs.load_state_dict({**to_megatron(ours.state_dict(), cfg), **extra}, strict=True)
    maps: list = []
    for layer in theirs.decoder.layers:
        layer.mlp.router.register_forward_hook(lambda m, i, out: maps.append(out))
    s = cfg.seq_length
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    with torch.no_grad(), stable_ties(stable), megart_routing() as seen:
        want = theirs(tokens, positions, mask)
        got = ours(tokens)
    v = cfg.vocab_size
    return dict(
        logits=((got[..., :v] - want[..., :v]).abs().max() / want[..., :v].abs().max()).item(),
        same_map=[torch.equal(c, m) for (_, c, _), (_, m) in zip(seen, maps, strict=True)],
        probs=max((p - q).abs().max().item() for (p, _, _), (q, _) in zip(seen, maps, strict=True)),
        dropped=[int((plain & ~c).sum()) for _, c, plain in seen],
        most=[int(c.sum(dim=0).max()) for _, c, _ in seen],
        least=[int(c.sum(dim=0).min()) for _, c, _ in seen],
    )


def compare_all(cases: list[tuple]) -> list[dict]:
    """For each (model kw, megart's model changes or None, stable ties, mistake or None):
    routing's figures and moe_workers.gradients' of one step (loss factor 0.5, expert biases
    drawn where the model has them), in one process. ``mistake`` "capacity-plus-one": megart's
    experts take one token more than their capacity."""
    from megart.models import moe_router

    out = []
    for kw, ours_kw, stable, mistake in cases:
        wrong = (
            mock.patch.object(moe_router, "expert_capacity", _plus_one(moe_router.expert_capacity))
            if mistake == "capacity-plus-one"
            else contextlib.nullcontext()
        )
        seed = 7 if kw.get("moe_router_enable_expert_bias") else None
        with stable_ties(stable), wrong:
            grads = mw.gradients(kw, 0.5, None, ours_kw, seed)
            out.append(dict(routing(kw, stable, ours_kw), **grads))
    return out


def _plus_one(real: Any) -> Any:
    return lambda tokens, cfg: real(tokens, cfg) + 1


def _per_group(real: Any, parts: int, groups: list[list[int]]) -> Any:
    """drop_tokens over each group of the rows' ``parts`` consecutive blocks apart (the
    blocks of the sequence one tensor- or context-parallel rank's router sees), each group's
    blocks in order."""

    def drop(probs: torch.Tensor, chosen: torch.Tensor, cfg: GPTConfig) -> tuple:
        rows = torch.arange(probs.shape[0]).chunk(parts)
        new_probs, new_chosen = torch.empty_like(probs), torch.empty_like(chosen)
        for group in groups:
            at = torch.cat([rows[b] for b in group])
            new_probs[at], new_chosen[at] = real(probs[at], chosen[at], cfg)
        return new_probs, new_chosen

    return drop


# How a layout's ranks split a one-process router's [s b] rows: (blocks, each rank's blocks).
SPLITS = {
    "tp2": (2, [[0], [1]]),  # sequence parallelism: each rank half the sequence
    "cp2": (4, [[0, 3], [1, 2]]),  # context parallelism's load-balanced chunks
}


def train(kw: dict, split: str | None = None) -> list[dict]:
    """A megart train run's history with flags ``kw``; ``split`` (SPLITS): each router drops
    over the groups of its tokens that layout's ranks hold, apart."""
    import train_workers as tw
    from megart.models import moe_router

    patch = (
        mock.patch.object(
            moe_router, "drop_tokens", _per_group(moe_router.drop_tokens, *SPLITS[split])
        )
        if split
        else contextlib.nullcontext()
    )
    with patch:
        return tw.train(**kw)


def drop_cases(cases: list[tuple]) -> list[bool]:
    """For each (tokens, experts, topk, factor, policy, pad, seed): whether megart's
    drop_tokens gives Megatron-Core's apply_router_token_dropping's probs and map exactly on a
    random top-k routing (Megatron-Core's position ties in order), and its capacity
    get_capacity's."""
    from megatron.core.transformer.moe import moe_utils

    from megart.models.moe_router import drop_tokens, expert_capacity

    same = []
    for tokens, experts, k, factor, policy, pad, seed in cases:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
        top = logits.topk(k, dim=1).indices
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        probs = torch.zeros_like(logits).scatter(1, top, torch.softmax(logits.gather(1, top), 1))
        cfg = GPTConfig(vocab_size=8, seq_length=8, hidden_size=8, num_layers=1,
                        num_attention_heads=1, bias=False, num_experts=experts,
                        moe_router_topk=k, moe_router_pre_softmax=k == 1,
                        moe_expert_capacity_factor=factor, moe_token_drop_policy=policy,
                        moe_pad_expert_input_to_capacity=pad)  # fmt: skip
        with stable_ties(True):
            want = moe_utils.apply_router_token_dropping(probs, chosen, k, factor, policy, pad)
        got = drop_tokens(probs, chosen, cfg)
        capacity = moe_utils.get_capacity(tokens * k, experts, factor)
        same.append(
            torch.equal(got[0], want[0])
            and torch.equal(got[1], want[1])
            and expert_capacity(tokens, cfg) == capacity
        )
    return same
