"""megart's router options next to Megatron-Core's (models.moe_router): its routing function on
the same logits, its MoE GPTModel's logits with the same expert biases, its update rule of the
expert bias on megart's counts; and megart train runs that return the expert biases they end
with. Run in launched processes, as megatron_core_workers."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import torch

import megatron_core_ckpt_workers as mckw
import megatron_core_workers as mcw
import moe_workers as mw
import train_workers as tw
from megart.models import GPT, GPTConfig, moe, moe_router
from megart.models.megatron_names import to_megatron


def routing(cases: list[tuple[dict, int]]) -> list[dict]:
    """For each (GPTConfig kw, seed): Megatron-Core's topk_routing_with_score_function and
    megart's route on the same float64 logits [64, E] (and fp32 expert bias where the config
    has one): the largest difference of the routing weights, whether the choices are the same,
    and how many tokens the bias (or the groups) moved off the plain top k."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    out = []
    for kw, seed in cases:
        cfg = GPTConfig(**kw)
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(64, cfg.num_experts, generator=g, dtype=torch.float64)
        bias = None
        if cfg.moe_router_enable_expert_bias:
            bias = torch.randn(cfg.num_experts, generator=g) * 0.3
        theirs, their_map = topk_routing_with_score_function(
            logits,
            cfg.moe_router_topk,
            use_pre_softmax=cfg.moe_router_pre_softmax,
            num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=cfg.moe_router_score_function,
            expert_bias=bias,
        )
        ours, chosen = moe.route(logits, cfg, bias)
        plain = moe.route(logits, GPTConfig(**{**kw, **PLAIN}))[1]
        out.append(
            dict(
                weights=(ours - theirs).abs().max().item(),
                same_choice=torch.equal(chosen, their_map),
                moved=int((chosen != plain).any(dim=1).sum()),
            )
        )
    return out


# Routing without the expert bias and the groups.
PLAIN = dict(moe_router_enable_expert_bias=False, moe_router_num_groups=None,
             moe_router_group_topk=None)  # fmt: skip


def _weights_from_biased_scores(logits: torch.Tensor, cfg: GPTConfig, bias=None):
    """A mistaken route: the expert bias in the routing weights as well."""
    if bias is None:
        return moe_router.route(logits, cfg)
    k = cfg.moe_router_topk
    weights, top = torch.topk(torch.sigmoid(logits) + bias, k, dim=1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(logits).scatter(1, top, weights)
    return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)


MISTAKES = {"bias-in-weights": (moe, "route", _weights_from_biased_scores)}


def logits(kw: dict, bias_seed: int, mistake: str | None = None) -> dict:
    """megart's weights (drawn) in Megatron-Core's MoE GPTModel, both routers' expert biases
    the same random numbers (moe_workers.set_expert_biases): the largest logit difference,
    megart's route mistaken where ``mistake`` says (MISTAKES)."""
    cfg = GPTConfig(**kw)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(3))  # fmt: skip
    ours = mcw.drawn(GPT(cfg).double())
    theirs = mcw.megatron_model(cfg)
    extra = {k: v for k, v in theirs.state_dict().items() if k.endswith(mw.MEGATRON_ONLY)}
    theirs.load_state_dict({**to_megatron(ours.state_dict(), cfg), **extra}, strict=True)
    mw.set_expert_biases(ours, theirs, bias_seed)
    patch = mock.patch.object(*MISTAKES[mistake]) if mistake else mock.MagicMock()
    with torch.no_grad(), patch:
        want = mcw.megatron_logits(theirs.eval(), tokens)
        got = ours.eval()(tokens)
    return dict(
        diff=(got - want[..., : got.shape[-1]]).abs().max().item(), scale=got.abs().max().item()
    )


def logits_all(cases: list[tuple]) -> list[dict]:
    return [logits(*case) for case in cases]


def bias_steps(kw: dict) -> dict:
    """A megart train run (one process) with the expert bias on: at each iteration's update,
    the counts and the biases before and after, and Megatron-Core's get_updated_expert_bias of
    the same counts and biases (its own function: its all-reduce over its one-rank world)."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    mcw.one_rank_world()
    steps = []
    real = moe_router.update_expert_bias

    def recorded(chunks, grid):
        routers = moe_router.biased_routers(chunks)
        counts = torch.stack([r.local_tokens_per_expert.clone() for r in routers])
        before = torch.stack([r.expert_bias.clone() for r in routers])
        real(chunks, grid)
        after = torch.stack([r.expert_bias.clone() for r in routers])
        rate = routers[0].rate
        megatron = get_updated_expert_bias(counts.clone(), before.clone(), rate)
        steps.append(dict(counts=counts, before=before, after=after, megatron=megatron))

    with mock.patch.object(moe_router, "update_expert_bias", recorded):
        history = tw.train(**kw)
    return dict(history=history, steps=steps)


def _unsummed(groups: tuple[str, ...]):
    """update_expert_bias with the counts not summed over the grid's ``groups``."""
    real = moe_router.update_expert_bias

    def update(chunks, grid):
        kept = {g: None if g in groups else getattr(grid, g) for g in ("tp_group", "dp_cp_group")}
        real(chunks, SimpleNamespace(**kept))

    return update


def _seq_loss_local(logits, cfg, seq, tp_group=None, cp_group=None):
    return moe_router.sequence_load_balancing_loss(logits, cfg, seq)


def _bias_not_loaded(*args):  # also: no group for the global loss's counts
    return None


UPDATE = "megart.models.moe_router.update_expert_bias"
# name: the (target, replacement) patches of the mistake
TRAIN_MISTAKES = {
    "counts-unsummed": [(UPDATE, _unsummed(("tp_group", "dp_cp_group")))],
    "counts-over-tp-only": [(UPDATE, _unsummed(("dp_cp_group",)))],
    "seq-counts-local": [("megart.models.moe.sequence_load_balancing_loss", _seq_loss_local)],
    "global-counts-local": [("megart.training.trainer_setup.set_global_group", _bias_not_loaded)],
    # megart's files and Megatron-LM's legacy ones; torch_dist stores.
    "bias-not-loaded": [
        ("megart.training.checkpoint.load_expert_bias", _bias_not_loaded),
        ("megart.training.megatron_dist_train_load.load_expert_bias", _bias_not_loaded),
    ],
}


def train_bias(kw: dict, mistake: str | None = None) -> dict:
    """A megart train run with flags ``kw`` (wrong on purpose where ``mistake`` says,
    TRAIN_MISTAKES): its history and every layer's expert bias at the end (zeros without)."""
    from megart.training.data import builtin_corpus
    from megart.training.trainer import Trainer

    with contextlib.ExitStack() as stack:
        for target, new in TRAIN_MISTAKES.get(mistake, []):
            stack.enter_context(mock.patch(target, new))
        t = Trainer(tw.tiny(**kw), tokens=builtin_corpus(1 << 16))
        history = t.train(quiet=True)
    cfg = t.model_config
    rows = None
    if cfg.moe_router_enable_expert_bias:
        rows = moe_router.expert_bias_rows(t.chunks, cfg, t.grid.pp_group, t.device)
    return dict(history=history, bias=rows)


def legacy_file_in_megatron_core(directory: str) -> dict:
    """The one-rank Megatron-LM legacy file megart train saved in ``directory``, loaded
    strictly by Megatron-Core's GPTModel (its args' model): its routers' expert biases against
    megart's record of them, and its logits against megart's GPT of the checkpoint's weights
    and biases."""
    from megart.training import checkpoint
    from megart.training.megatron_args import config_from_args
    from megart.training.megatron_files import torch_load

    root = checkpoint.iteration_dir(directory, checkpoint.latest_iteration(directory))
    state = torch_load(root / "mp_rank_00" / checkpoint.FILE)
    rows = state["megart"]["expert_bias"]
    cfg = config_from_args(vars(state["args"]))
    theirs = mcw.megatron_model(cfg)
    theirs.load_state_dict(state["model"], strict=True)
    routers = [layer.mlp.router for layer in theirs.decoder.layers]
    same = all(torch.equal(r.expert_bias.float(), rows[i]) for i, r in enumerate(routers))
    ours = mckw.checkpoint_gpt(directory)[0]
    moe_router.load_expert_bias([ours.chunk], rows)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(5))  # fmt: skip
    with torch.no_grad():
        want = ours.eval()(tokens)
    got = mcw.megatron_logits(theirs.eval(), tokens)[..., : want.shape[-1]]
    return dict(
        same_bias=same, nonzero=int((rows != 0).sum()), diff=(got - want).abs().max().item()
    )


def store_biases_in_megatron_core(directory: str) -> torch.Tensor:
    """megart train's torch_dist store (one rank) in ``directory`` loaded by Megatron-Core's
    GPTModel as megatron_dist_workers.load_and_run loads it (strictly): its routers' expert
    biases, [layers, E]."""
    from unittest import mock

    import megatron_dist_workers as mdw

    models = []

    def kept(*args, **kw):
        models.append(mcw.megatron_model(*args, **kw))
        return models[-1]

    with mock.patch.object(mdw, "megatron_model", kept):
        mdw.load_and_run(directory, torch.zeros(1, 8, dtype=torch.long), 1, 1)
    return torch.stack([layer.mlp.router.expert_bias for layer in models[0].decoder.layers])


def megatron_core_store_with_biases(kw: dict, directory: str) -> torch.Tensor:
    """Megatron-Core's GPTModel of ``kw`` (one rank), its routers' expert biases drawn at
    random, saved to a torch_dist store in ``directory`` by megatron_dist_workers.save_megatron;
    the biases, [MoE layers, E]."""
    from unittest import mock

    import megatron_dist_workers as mdw

    g = torch.Generator().manual_seed(9)
    biases = []

    def drawn(*args, **kw):
        model = mcw.megatron_model(*args, **kw)
        for layer in model.decoder.layers:
            if hasattr(layer.mlp, "router"):
                bias = torch.randn(layer.mlp.router.expert_bias.shape, generator=g)
                layer.mlp.router.expert_bias.copy_(bias)
                biases.append(bias)
        return model

    cfg = GPTConfig(**kw)
    tokens = torch.zeros(1, cfg.seq_length, dtype=torch.long)
    with mock.patch.object(mdw, "megatron_model", drawn):
        mdw.save_megatron(kw, directory, 1, 1, tokens)
    return torch.stack(biases)
