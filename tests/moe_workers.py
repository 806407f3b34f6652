"""megart's mixture-of-experts GPT next to Megatron-Core's (local spec, SequentialMLP experts,
the allgather dispatcher, CPU, float64): the gradients of one training step, with the
load-balancing loss and the z-loss, under a loss factor such as a pipeline run's 1/m. Run in a
launched process, as megatron_core_workers."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megart.models import GPT, GPTConfig
from megart.models.megatron_names import from_megatron, to_megatron
from megart.models.moe_router import biased_routers
from megatron_core_workers import drawn, megatron_model

# Megatron-Core's model state that megart's state dict does not name: Transformer Engine's
# extra state, and the routers' expert bias (megart keeps it beside the weights).
MEGATRON_ONLY = ("_extra_state", "router.expert_bias")


# The losses Megatron-Core's tracker logs, by its names.
LOGGED = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(logits[..., :vocab].reshape(-1, vocab), labels.reshape(-1))


def gradients(
    kw: dict,
    factor: float = 0.5,
    ours_factor: float | None = None,
    ours_kw: dict | None = None,
    bias_seed: int | None = None,
    microbatches: int = 1,
    mistake: str | None = None,
) -> dict:
    """One step of both models on the same weights, each loss times ``factor``, Megatron-Core's
    auxiliary losses scaled by it (MoEAuxLossAutoScaler.set_loss_scale, as its schedules set
    loss scale / m) and megart's by ``ours_factor`` (default the same; GPTChunk.set_loss_scale,
    as megart's engine sets it); ``ours_kw`` changes megart's model only (the same weights);
    ``bias_seed``: both models' expert biases drawn from it (set_expert_biases);
    ``microbatches``: that many forward and backward passes, the gradients accumulated.
    ``mistake`` makes megart's shared-expert gate wrong on purpose (gate_mistake).
    Returns the largest gradient difference over all parameters
    relative to the largest gradient, and the router weights' alone."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    cfg = GPTConfig(**kw)
    g = torch.Generator().manual_seed(5)
    shape = (2 * microbatches, cfg.seq_length)
    tokens = torch.randint(0, cfg.vocab_size, shape, generator=g).split(2)
    labels = torch.randint(0, cfg.vocab_size, shape, generator=g).split(2)
    ours = drawn(GPT(cfg).double())
    theirs = megatron_model(cfg)
    if ours_kw:
        changed = GPT(GPTConfig(**{**kw, **ours_kw})).double()
        changed.load_state_dict(ours.state_dict())
        ours, theirs_weights = changed, ours.state_dict()
    else:
        theirs_weights = ours.state_dict()
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith(MEGATRON_ONLY)}
    theirs.load_state_dict({**to_megatron(theirs_weights, cfg), **extra}, strict=True)
    if bias_seed is not None:
        set_expert_biases(ours, theirs, bias_seed)

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(factor, dtype=torch.float64))
    moe_utils.clear_aux_losses_tracker()
    s = cfg.seq_length
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens[0])
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    theirs.train()
    for x, y in zip(tokens, labels, strict=True):
        (lm_loss(theirs(x, positions, mask), y, cfg.vocab_size) * factor).backward()

    ours.train()
    ours.chunk.set_loss_scale(factor if ours_factor is None else ours_factor)
    with gate_mistake(mistake):
        for x, y in zip(tokens, labels, strict=True):
            (lm_loss(ours(x), y, cfg.vocab_size) * factor).backward()

    want = from_megatron({n: p.grad for n, p in theirs.named_parameters()}, cfg)
    got = {n: p.grad for n, p in ours.chunk.named_parameters()}
    assert set(want) == set(got), set(want) ^ set(got)
    top = max(w.abs().max().item() for w in want.values())
    diff = {n: (got[n] - want[n]).abs().max().item() / top for n in want}
    routers = [d for n, d in diff.items() if n.endswith("mlp.router.weight")]
    # The losses each logs, per layer (0 where none: Megatron-Core's dense layers), for this
    # one microbatch: Megatron-Core's tracker (its unweighted values) and megart's.
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    ours_logged = ours.chunk.aux_loss_scale.take()
    layers = range(len(ours.chunk.blocks))
    logged = {
        name: (
            [float(ours_logged[name].get(i, 0.0)) for i in layers],
            tracker[name]["values"].tolist() if name in tracker else [float("nan")],
        )
        for name in LOGGED
        if name in ours_logged
    }
    # The tokens each expert got, counted for the expert bias's update (where it is on).
    counts = [
        (r.local_tokens_per_expert.tolist(), theirs.decoder.layers[r.layer].mlp.router)
        for r in biased_routers([ours.chunk])
    ]
    counted = [mine == t.local_tokens_per_expert.tolist() for mine, t in counts]
    gate = max([d for n, d in diff.items() if "shared_expert_gate" in n], default=None)
    return dict(
        largest=max(diff.values()),
        router=max(routers),
        gate=gate,
        top=top,
        logged=logged,
        counted=counted,
    )


def set_expert_biases(ours: GPT, theirs: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Both models' routers' expert biases the same random fp32 numbers (``scale`` times
    normal ones), enough to change which experts sigmoid scores choose."""
    g = torch.Generator().manual_seed(seed)
    for router in biased_routers([ours.chunk]):
        bias = torch.randn(router.expert_bias.shape, generator=g) * scale
        router.expert_bias.copy_(bias)
        theirs.decoder.layers[router.layer].mlp.router.expert_bias.copy_(bias)


def gradients_all(cases: list[tuple]) -> list[dict]:
    """gradients of each case, (kw, factor, ours_factor, ours_kw[, bias_seed, microbatches,
    mistake]), in one launched process."""
    return [gradients(*case) for case in cases]


def gate_mistake(mistake: str | None) -> Any:
    """A patch of megart's shared-expert gate that makes ``mistake``: "gate-not-applied" (the
    shared experts' output as it is), "gate-without-sigmoid" (times x . w itself); nothing for
    None or another mistake (moe_tp_workers' own)."""
    from unittest import mock

    from megart.models import moe

    wrong = {
        # Its weight kept in the graph (a zero gradient), as the comparison needs one.
        "gate-not-applied": lambda self, x: 1 + 0 * F.linear(x, self.weight),
        "gate-without-sigmoid": lambda self, x: F.linear(x, self.weight),
    }
    if mistake not in wrong:
        return mock.MagicMock()  # a context manager that changes nothing
    return mock.patch.object(moe.SharedExpertGate, "forward", wrong[mistake])


def step_gradients(kw: dict) -> dict:
    """Every gradient after one megart train iteration with flags ``kw``, by place."""
    import train_workers as tw

    return tw.gradients_after_one_step(**kw)


def auxiliary_factor(kw: dict) -> tuple[float, float]:
    """After one megart train iteration with flags ``kw`` (one process): the factor its MoE
    layers' auxiliary losses were seeded with, and the loss scale / microbatches the engine
    scaled the language model's loss by."""
    import train_workers as tw
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(train_iters=1, **kw), tokens=builtin_corpus(1 << 16))
    scale = trainer.scaler.scale if trainer.scaler is not None else 1.0
    trainer.train(quiet=True)
    m = trainer.config.microbatches(1)
    return trainer.chunks[0].aux_loss_scale.value, float(scale) / m


def train_mistaken(kw: dict, mistake: str | None = None) -> list[dict]:
    """The history of a megart train run with flags ``kw``, its MoE layers wrong on purpose
    under context parallelism where ``mistake`` says: "counts-over-t-only" (the load-balancing
    loss's counts not summed over the cp ranks, nor T counted over them), "z-undivided" (the
    z-loss coefficient not divided by cp), "seed-without-cp" (the auxiliary losses' gradients
    seeded with the language model's factor, not cp times it)."""
    from unittest import mock

    import train_workers as tw
    from megart.models import moe

    cp = kw.get("context_parallel_size", 1)
    patches = {
        None: mock.MagicMock(),  # a context manager that changes nothing
        "counts-over-t-only": mock.patch.object(
            moe, "load_balancing_loss", _without_cp(moe.load_balancing_loss)
        ),
        "z-undivided": mock.patch.object(moe, "z_loss", lambda x, c, z=moe.z_loss: z(x, c * cp)),
        "seed-without-cp": mock.patch.object(
            moe.MoE,
            "_attach",
            lambda m, x, loss, name, c: moe._SeedGradient.apply(
                x, loss, m.loss_scale, 1, name, c, m.layer
            ),
        ),
    }
    with patches[mistake]:
        return tw.train(**kw)


def _without_cp(real: object) -> object:
    return lambda x, cfg, tp_group=None, cp_group=None: real(x, cfg, tp_group)


def refusal(kw: dict) -> str:
    """The ConfigError's message a megart train run with flags ``kw`` stops with ("" if none)."""
    import train_workers as tw
    from megart import ConfigError

    try:
        tw.train(**kw)
    except ConfigError as e:
        return str(e)
    return ""


def forward_calls(kw: dict) -> tuple[dict, dict]:
    """One megart train iteration with flags ``kw`` (one process): every gradient by place,
    and how many times each kind of module ran forward ("router", "shared_experts", "expert",
    "moe", "dense_mlp"), recomputation's second runs included."""
    from collections import Counter

    import train_workers as tw
    from megart.models.mlp import MLP
    from megart.models.moe import MoE, Router
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    trainer = Trainer(tw.tiny(train_iters=1, **kw), tokens=builtin_corpus(1 << 16))
    calls: Counter = Counter()
    for chunk in trainer.chunks:
        for name, module in chunk.named_modules():
            last = name.rsplit(".", 1)[-1]
            kind = (
                "router" if isinstance(module, Router)
                else "moe" if isinstance(module, MoE)
                else "shared_experts" if last == "shared_experts"
                else "expert" if isinstance(module, MLP) and ".experts." in name
                else "dense_mlp" if isinstance(module, MLP)
                else None
            )  # fmt: skip
            if kind is not None:
                module.register_forward_pre_hook(lambda *_, k=kind: calls.update([k]))
    trainer.train(quiet=True)
    return tw.by_place(trainer, lambda p: p.grad), dict(calls)
