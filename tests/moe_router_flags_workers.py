"""Workers of tests/test_moe_router_flags.py: the MoE layer with the router's noise against a
float64 reference written out here, and megart train runs with the three flags, some with a
mistake made on purpose (MISTAKES)."""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch

import train_workers as tw
from megart.models import router_noise
from megart.models.config import GPTConfig
from megart.models.moe import AuxLossScale, MoE

LAYER = dict(vocab_size=64, seq_length=8, hidden_size=16, num_layers=2, num_attention_heads=2,
             bias=False, num_experts=4, moe_router_topk=2)  # fmt: skip


def _layer(**kw: Any) -> MoE:
    cfg = GPTConfig(**{**LAYER, **kw})
    return MoE(cfg, 1, AuxLossScale()).double()


def _reference(layer: MoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The layer's output for [s, b, h] ``x`` routed by [s b, E] ``logits`` (the top k
    logits' softmax weighing the layer's own experts), written out in float64."""
    tokens = x.reshape(-1, x.shape[-1])
    top, chosen = torch.topk(logits, layer.cfg.moe_router_topk, dim=1)
    weights = torch.exp(top - top.max(dim=1, keepdim=True).values)
    weights = weights / weights.sum(dim=1, keepdim=True)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[t, j])
            out[t] += weights[t, j] * layer.experts[e](tokens[t : t + 1])[0]
    return out.view(x.shape)


def _grads(layer: MoE, x: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of sum(out * w) (w fixed) with respect to ``x`` and every weight."""
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    params = [x, *layer.parameters()]
    grads = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def layer_against_reference(kind: str) -> dict[str, float]:
    """The largest differences between the layer (``kind``: jitter or force) and the
    reference given the same noise, output and gradients; and, for jitter, its evaluation
    output against a layer without the noise and its training-mode output (which a layer
    that left the jitter on in evaluation would give) against the same."""
    flags = dict(moe_input_jitter_eps=0.2) if kind == "jitter" else {}
    flags |= dict(moe_router_force_load_balancing=True) if kind == "force" else {}
    layer = _layer(**flags)
    layer.loss_scale.noise.start(("train", 3), 5)
    layer.loss_scale.noise.microbatch = 1
    x = torch.randn(8, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x.requires_grad_()
    out = layer(x)
    key, groups = layer.loss_scale.noise, (None, None)
    tokens = x.reshape(-1, 16)
    where = (layer.cfg.seed, 1)
    if kind == "jitter":
        noise = router_noise.token_noise(
            key, (*where, "input_jitter"), (8, 2, 16), groups, x, router_noise.uniform(0.2)
        ).view(-1, 16)
        logits = (tokens * noise) @ layer.router.weight.t()
    else:
        noise = router_noise.token_noise(
            key, (*where, "force_load_balancing"), (8, 2, 4), groups, x, router_noise.normal
        ).view(-1, 4)
        product = tokens @ layer.router.weight.t()
        logits = product + (noise - product).detach()  # its value, its gradient the product's
    want = _reference(layer, x, logits)
    got_grads, want_grads = _grads(layer, x, out), _grads(layer, x, want)
    r = dict(
        output=float((out - want).detach().abs().max()),
        grads=max(float((g - w).abs().max()) for g, w in zip(got_grads, want_grads, strict=True)),
        router_grad=float(got_grads[1 + 0].abs().max()),  # the router's weight: it learns
        noise_spread=float((noise - noise.mean()).abs().max()),
    )
    if kind == "jitter":
        plain = _layer()
        plain.load_state_dict(layer.state_dict())
        with torch.no_grad():
            plain_out = plain(x)
            layer.eval()
            r["eval"] = float((layer(x) - plain_out).abs().max())
            layer.train()
            r["left_on"] = float((layer(x) - plain_out).abs().max())
    return r


def _tp_rank_noise(original: Any) -> Any:
    """token_noise drawn from generators that also depend on the tensor-parallel rank."""

    def drawn(key, where, shape, groups, like, draw):  # noqa: ANN001, ANN202
        return original(key, (*where, router_noise.group_rank(groups[0])), shape, groups, like,
                        draw)  # fmt: skip

    return drawn


def _forward_naming_only(original: Any) -> Any:
    """The engine names each microbatch before its forward only: recomputation in its
    backward draws whatever microbatch ran last."""

    def named(self, a):  # noqa: ANN001, ANN202
        seen = self.__dict__.setdefault("_named_once", set())
        if (a.mb, a.chunk) in seen:
            seen.discard((a.mb, a.chunk))
            return None
        seen.add((a.mb, a.chunk))
        return original(self, a)

    return named


def _local_layer(original: Any) -> Any:
    """Each stage tracks its losses under its layers' chunk-local numbers (layer mod 2 for
    two layers a stage)."""

    def track(self, name, value, layer=0):  # noqa: ANN001, ANN202
        return original(self, name, value, layer % 2)

    return track


MISTAKES = {
    "noise-per-tp-rank": ("megart.models.moe.token_noise", _tp_rank_noise),
    "no-replay": (
        "megart.pipeline.engine.PipelineEngine._name_microbatch", _forward_naming_only),
    "local-layer": ("megart.models.moe.AuxLossScale.track", _local_layer),
}  # fmt: skip


def train_flags(kw: dict, mistake: str | None = None) -> list[dict]:
    """A megart train run with flags ``kw`` (wrong on purpose where ``mistake`` says):
    its history."""
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    with contextlib.ExitStack() as stack:
        if mistake is not None:
            target, wrap = MISTAKES[mistake]
            stack.enter_context(mock.patch(target, wrap(_resolve(target))))
        t = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
        return t.train(quiet=True)


def _resolve(target: str) -> Any:
    """The object ``target`` (a dotted path, as mock.patch takes) names now."""
    module, _, attr = target.rpartition(".")
    owner: Any
    try:
        owner = __import__(module, fromlist=["_"])
    except ModuleNotFoundError:  # a class's attribute
        parent, _, cls = module.rpartition(".")
        owner = getattr(__import__(parent, fromlist=["_"]), cls)
    return getattr(owner, attr)
