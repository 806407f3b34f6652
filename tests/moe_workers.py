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
from megatron_core_workers import drawn, megatron_model


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(logits[..., :vocab].reshape(-1, vocab), labels.reshape(-1))


def gradients(
    kw: dict,
    factor: float = 0.5,
    ours_factor: float | None = None,
    ours_kw: dict | None = None,
    mistake: str | None = None,
) -> dict:
    """One step of both models on the same weights, each loss times ``factor``, Megatron-Core's
    auxiliary losses scaled by it (MoEAuxLossAutoScaler.set_loss_scale, as its schedules set
    loss scale / m) and megart's by ``ours_factor`` (default the same; GPTChunk.set_loss_scale,
    as megart's engine sets it); ``ours_kw`` changes megart's model only (the same weights);
    ``mistake`` makes megart's shared-expert gate wrong on purpose (gate_mistake).
    Returns the largest gradient difference over all parameters
    relative to the largest gradient, and the router weights' alone."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    cfg = GPTConfig(**kw)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    ours = drawn(GPT(cfg).double())
    theirs = megatron_model(cfg)
    if ours_kw:
        changed = GPT(GPTConfig(**{**kw, **ours_kw})).double()
        changed.load_state_dict(ours.state_dict())
        ours, theirs_weights = changed, ours.state_dict()
    else:
        theirs_weights = ours.state_dict()
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith("_extra_state")}
    theirs.load_state_dict({**to_megatron(theirs_weights, cfg), **extra}, strict=True)

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(factor, dtype=torch.float64))
    moe_utils.clear_aux_losses_tracker()
    s = cfg.seq_length
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    theirs.train()
    (lm_loss(theirs(tokens, positions, mask), labels, cfg.vocab_size) * factor).backward()

    ours.train()
    ours.chunk.set_loss_scale(factor if ours_factor is None else ours_factor)
    with gate_mistake(mistake):
        (lm_loss(ours(tokens), labels, cfg.vocab_size) * factor).backward()

    want = from_megatron({n: p.grad for n, p in theirs.named_parameters()}, cfg)
    got = {n: p.grad for n, p in ours.chunk.named_parameters()}
    assert set(want) == set(got), set(want) ^ set(got)
    top = max(w.abs().max().item() for w in want.values())
    diff = {n: (got[n] - want[n]).abs().max().item() / top for n in want}
    routers = [d for n, d in diff.items() if n.endswith("mlp.router.weight")]
    # The losses each logs, per MoE layer: Megatron-Core's tracker (its unweighted values)
    # and megart's (summed over layers there), for this one microbatch.
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    ours_logged = ours.chunk.aux_loss_scale.take()
    logged = {
        name: (float(ours_logged[name]), float(tracker[name]["values"].sum()))
        for name in ("load_balancing_loss", "z_loss")
        if name in ours_logged
    }
    gate = max([d for n, d in diff.items() if "shared_expert_gate" in n], default=None)
    return dict(largest=max(diff.values()), router=max(routers), gate=gate, top=top, logged=logged)


def gradients_all(cases: list[tuple]) -> list[dict]:
    """gradients of each case, (kw, factor, ours_factor, ours_kw[, mistake]), in one launched
    process."""
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
            lambda m, x, loss, name, c: moe._SeedGradient.apply(x, loss, m.loss_scale, 1, name, c),
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
