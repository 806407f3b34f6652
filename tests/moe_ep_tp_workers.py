"""megart's mixture-of-experts GPT at tensor-parallel size 2 (sequence parallelism on) with its
experts spread over 2 expert-parallel ranks, next to Megatron-Core's GPTModel built the same way
(its parallel_state at tp 2, expert-model-parallel size 2, the expert tensor-parallel size left
at tp; SequentialMLP experts, the allgather or alltoall dispatcher, CPU, float64), on 4 launched
processes sharing torch.distributed's default group with Megatron-Core: each rank holding its
own pieces of one set of weights (its tensor-parallel shards, its expert-parallel rank's
experts) and its data-parallel rank's own tokens, the logits and the gradients of one
training step with the load-balancing loss and the z-loss, before any data-parallel average
(each expert's already sums the tokens sent to it from both data-parallel ranks)."""

from __future__ import annotations

import re

import torch

import megart.distributed as dist
from megart.models import GPTConfig, moe
from megart.models.megatron_names import to_megatron
from megart.models.vocab import fit_vocab
from megart.parallel import make_layout
from megart.parallel.experts import expert_groups
from megart.tensor_parallel import scatter_to_sequence_region
from megart.tensor_parallel._group import group_rank
from megart.training.megatron_layout import shard
from megatron_core_workers import drawn, megatron_model
from megatron_ep_start import megatron_ep
from moe_tp_workers import (
    _our_grads,
    _ours,
    _their_grads,
    backward_both,
    compared,
    renumbered_experts,
)

TP, EP = 2, 2


def _theirs(
    whole: dict, cfg: GPTConfig, tp_rank: int, first: int, dispatcher: str
) -> torch.nn.Module:
    """Megatron-Core's GPTModel at TP x EP with its token ``dispatcher``, strictly loading this
    rank's tensor-parallel pieces of ``whole`` and its experts (global ``first`` onwards, local
    0 onwards)."""
    from unittest import mock

    import megatron_core_workers

    real = megatron_core_workers.moe_config
    with mock.patch.object(
        megatron_core_workers,
        "moe_config",
        lambda c: {**real(c), "moe_token_dispatcher_type": dispatcher},
    ):
        model = megatron_model(cfg, TP, sequence_parallel=True, ep=EP)
    local = cfg.num_experts // EP
    state = {}
    for name, value in to_megatron({k: v.clone() for k, v in whole.items()}, cfg).items():
        held = re.search(r"\.local_experts\.(\d+)\.", name)
        if held and not first <= int(held[1]) < first + local:
            continue
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            value = fit_vocab(value, cfg.padded_vocab_size(TP))
        state[name] = shard(name, value, cfg, TP, tp_rank)
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    model.load_state_dict({**renumbered_experts(state, -first), **extra}, strict=True)
    return model


def compare(kw: dict, factor: float, dispatcher: str, groups: tuple, mistake: str | None) -> dict:
    """One model on this rank: the largest logit difference of megart's from Megatron-Core's
    and from megart's one process (on this data-parallel rank's tokens), then one training
    step of both (Megatron-Core's with its token ``dispatcher``): the largest difference over
    this rank's gradients (the experts' over their tensor-parallel shards, the rest completed
    as in moe_tp_workers), relative to the largest. ``mistake`` "experts-output-sliced": the
    exchanged experts' outputs not summed over the tensor-parallel group."""
    from unittest import mock

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megart.models import GPT

    tp_group, ep_group = groups
    cfg = GPTConfig(**kw)
    tp_rank, ep_rank = group_rank(tp_group), group_rank(ep_group)
    assert ep_rank == parallel_state.get_expert_model_parallel_rank()
    dp_rank = dist.get_rank() // TP
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, cfg.vocab_size, (2, 2, cfg.seq_length), generator=g) for _ in "ab"]
    tokens, labels = batches[dp_rank]
    one = drawn(GPT(cfg).double())
    whole = {k: v.detach().clone() for k, v in one.chunk.state_dict().items()}
    first = ep_rank * cfg.num_experts // EP
    ours, theirs = (
        _ours(whole, cfg, tp_group, ep_group),
        _theirs(whole, cfg, tp_rank, first, dispatcher),
    )

    s, v = cfg.seq_length, cfg.vocab_size
    positions = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    wrong = mock.patch.object(
        moe, "reduce_scatter_to_sequence_region", scatter_to_sequence_region
    ) if mistake == "experts-output-sliced" else mock.MagicMock()  # fmt: skip
    ours.eval(), theirs.eval(), one.eval()
    with torch.no_grad(), wrong:
        want = one(tokens)[..., :v]
        got = ours(tokens)[..., :v]
        megatron = gather_from_tensor_model_parallel_region(theirs(tokens, positions, mask))
        megatron = megatron.contiguous()[..., :v]

    backward_both(ours, theirs, (tokens, labels, positions, mask), factor, wrong)

    want_grads = _their_grads(theirs, cfg, tp_group, first)
    got_grads = _our_grads(ours, tp_group, None)
    figures, diff = compared((got, want, megatron), want_grads, got_grads, v)
    experts = {n: d for n, d in diff.items() if ".experts." in n}
    held = {int(n.split(".experts.")[1].split(".")[0]) for n in experts}
    return dict(figures, experts=max(experts.values()), held=sorted(held))


def compare_all(cases: list[tuple]) -> list[dict]:
    """compare of each case (kw, factor, dispatcher, mistake) on each of the TP x EP launched
    ranks, in one torch.distributed world shared by megart and Megatron-Core."""
    with megatron_ep(TP, 1, EP, megart_groups=True):
        layout = make_layout(TP * EP, tp=TP)
        mine = {}
        for kind, ranks_list in (("tp", layout.groups("tp")), ("ep", expert_groups(layout, EP)[0])):
            for ranks in ranks_list:
                group = dist.new_group(list(ranks))
                if dist.get_rank() in ranks:
                    mine[kind] = group
        groups = (mine["tp"], mine["ep"])
        return [compare(kw, f, dispatcher, groups, mistake) for kw, f, dispatcher, mistake in cases]
