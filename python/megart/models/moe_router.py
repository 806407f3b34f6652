"""The router of megart's MoE layers (models.moe), as Megatron-Core 0.16's TopKRouter: logits
from a linear gate, top-k routing by a score function, and the router's load-balancing devices.

Routing (``route``): softmax over the top k logits, softmax over all experts then the top k
(--moe-router-pre-softmax), or sigmoid scores whose top k are normalised to sum to 1; times
--moe-router-topk-scaling-factor. Group-limited routing (--moe-router-num-groups G,
--moe-router-group-topk g; DeepSeek's device- and node-limited routing): the experts are G
consecutive groups, each token picks the g groups whose top k/g scores sum highest, then its
top k experts within those.

Aux-loss-free balancing (--moe-router-enable-expert-bias, sigmoid scores only, as Megatron
requires): a per-expert bias, ``expert_bias`` (fp32), added to the scores only to choose the top
k (the weights stay the unbiased scores). Training counts the tokens each expert was chosen for
(``local_tokens_per_expert``, in backward, so once per microbatch even where recomputation runs
a layer's forward twice), and once per iteration, after the gradients are complete and before
the step (Megatron-Core's finalize_model_grads, whether or not fp16 skips the step),
``update_expert_bias`` sums the counts over the tensor-, data- and context-parallel ranks (every
rank routes its own tokens; a layer lives on one pipeline stage) and moves each bias by
--moe-router-bias-update-rate towards balance: up where an expert got fewer than the mean,
down where more, unchanged where exactly the mean (the sign of the difference).

Token dropping (--moe-expert-capacity-factor C, Megatron-Core's apply_router_token_dropping):
after routing, each expert keeps at most ceil(T k / E x C) of the T tokens this router routed
(this rank's: under sequence or context parallelism its slice of the sequence, under data and
expert parallelism its own microbatch, as Megatron-Core's router counts them); --moe-token-drop-
policy probs keeps the highest routing weights, position the earliest tokens ([s, b] order).
A dropped copy gets weight 0 and goes nowhere (the residual still carries the token); a
capacity above T drops nothing. --moe-pad-expert-input-to-capacity: each expert takes exactly
its capacity (T where that is more), the free places filled with tokens not routed to it at
weight 0, which add nothing to the output nor any gradient. The bias's counts are the
tokens kept (with padding, the capacity), as Megatron-Core counts its final map.

The load-balancing losses (their values; models.moe attaches them): --moe-router-load-balancing-
type aux_loss, the Switch Transformer's over each microbatch, and seq_aux_loss, DeepSeek's,
the same loss over each sequence of the microbatch and averaged over them; both count choices by
the unbiased scores' plain top k (Megatron-Core's compute_routing_scores_for_aux_loss) and, under
tensor (so sequence) and context parallelism, over the t x cp ranks' tokens. global_aux_loss
counts them over the data-parallel ranks too and averages the counts over the iteration's
microbatches so far (a running sum on the router, started again each iteration): each rank's
loss is its share of the global batch's, so that the data-parallel average of the gradients
weighs it 1/dp, as Megatron-Core's does. Its counts grow in each training forward: full
recomputation, which runs a forward twice, is refused with it (moe_checks).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import megart.distributed as dist
from megart.distributed import ProcessGroup
from megart.models.config import GPTConfig
from megart.models.init import generator, weight_init
from megart.tensor_parallel._group import group_size

_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def _softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over experts in fp32 at least, in the logits' dtype (Megatron-Core's; float64
    logits keep float64 here, where it rounds to fp32)."""
    return torch.softmax(x, dim=-1, dtype=torch.promote_types(x.dtype, torch.float32)).type_as(x)


def top_experts(scores: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The top moe_router_topk of [T, E] ``scores`` per token: their values and indices; under
    group-limited routing, among the experts of the moe_router_group_topk groups whose top
    k / group_topk scores sum highest."""
    k, groups, chosen_groups = (
        cfg.moe_router_topk,
        cfg.moe_router_num_groups,
        cfg.moe_router_group_topk,
    )
    if not chosen_groups:
        return torch.topk(scores, k, dim=1)
    tokens, experts = scores.shape
    grouped = scores.view(tokens, groups, experts // groups)
    group_scores = grouped.topk(k // chosen_groups, dim=-1).values.sum(dim=-1)
    picked = torch.topk(group_scores, chosen_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, picked, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~keep, float("-inf")), k, dim=1)


def route(
    logits: torch.Tensor, cfg: GPTConfig, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-Core's top-k routing of [T, E] logits: each token's routing weights ([T, E],
    zero off its k experts) and which experts it goes to ([T, E] bool). ``expert_bias``
    (sigmoid scores only): added to the scores to choose, not to the weights."""
    k = cfg.moe_router_topk
    if cfg.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is None:
            weights, top = top_experts(scores, cfg)
        else:
            top = top_experts(scores + expert_bias, cfg).indices
            weights = torch.gather(scores, 1, top)
        if k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif cfg.moe_router_pre_softmax:  # softmax over all experts, the top k's weights kept
        weights, top = top_experts(_softmax(logits), cfg)
    else:  # softmax over the top k logits
        top_logits, top = top_experts(logits, cfg)
        weights = _softmax(top_logits)
    if cfg.moe_router_topk_scaling_factor:
        weights = weights * cfg.moe_router_topk_scaling_factor
    probs = torch.zeros_like(logits).scatter(1, top, weights)
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    if cfg.moe_expert_capacity_factor is None:
        return probs, chosen
    return drop_tokens(probs, chosen, cfg)


def expert_capacity(tokens: int, cfg: GPTConfig) -> int:
    """How many of ``tokens`` routed tokens each expert takes: ceil(T k / E x C), in
    Megatron-Core's float arithmetic (get_capacity)."""
    share = tokens * cfg.moe_router_topk / cfg.num_experts
    return math.ceil(share * cfg.moe_expert_capacity_factor)


def drop_tokens(
    probs: torch.Tensor, chosen: torch.Tensor, cfg: GPTConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] ``probs`` and ``chosen`` with each expert's tokens beyond its capacity dropped
    (weight 0, not chosen) by cfg's policy; with padding, each expert's chosen rows its
    capacity (T where that is more), filled with unrouted tokens at weight 0."""
    tokens = probs.shape[0]
    capacity = expert_capacity(tokens, cfg)
    if capacity > tokens:  # no expert can overflow
        kept = torch.ones_like(chosen)
    else:
        if cfg.moe_token_drop_policy == "probs":  # each expert's highest weights
            rows = torch.topk(probs, capacity, dim=0, sorted=False).indices
        else:  # its routed tokens first, earliest first (a stable sort keeps positions' order)
            rows = torch.sort(chosen.to(torch.uint8), dim=0, descending=True, stable=True)
            rows = rows.indices[:capacity]
        kept = torch.zeros_like(chosen).scatter(0, rows, True)
    final = kept if cfg.moe_pad_expert_input_to_capacity else chosen & kept
    return probs * final, final


def _balance_scores(logits: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The full scores the load-balancing losses weigh ([T, E]) and which experts their plain
    top k holds (float 0/1): no bias, no groups, as Megatron-Core counts them."""
    if cfg.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        wide = torch.promote_types(logits.dtype, torch.float32)  # fp32 scores from bf16 logits
        scores = torch.softmax(logits, dim=-1, dtype=wide)
    top = torch.topk(scores, cfg.moe_router_topk, dim=1).indices
    return scores, torch.zeros_like(scores).scatter(1, top, 1.0)


def _summed(
    chosen: torch.Tensor, tokens: int, groups: list[ProcessGroup | None]
) -> tuple[torch.Tensor, int]:
    """The counts of [N, C] ``chosen`` per column summed over ``groups`` (one after the other:
    the sum over all their ranks, exact), and ``tokens`` times the groups' sizes."""
    counts = chosen.sum(dim=0)
    if any(group_size(g) > 1 for g in groups):  # counts of choices: no gradient flows through them
        counts = counts.detach().clone()
        for group in groups:
            if group_size(group) > 1:
                dist.all_reduce(counts, group=group)
                tokens *= group_size(group)
    return counts, tokens


def _switch_loss(
    scores: torch.Tensor, counts: torch.Tensor, tokens: int, cfg: GPTConfig
) -> torch.Tensor:
    """E coeff / (k T^2) sum_c (sum_x scores(x, c)) counts(c) over the columns c of [N, C]
    ``scores`` (T: ``tokens``)."""
    k, experts = cfg.moe_router_topk, cfg.num_experts
    scale = experts * cfg.moe_aux_loss_coeff / (k * tokens * tokens)
    return torch.sum(scores.sum(dim=0) * counts) * scale


def load_balancing_loss(
    logits: torch.Tensor,
    cfg: GPTConfig,
    tp_group: ProcessGroup | None = None,
    cp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """The Switch Transformer's loss over these T tokens, times --moe-aux-loss-coeff:
    E coeff / (k T^2) sum_i (sum_x s(x, i)) (tokens whose top k hold i), s the full scores.
    Under tensor (so sequence) and context parallelism, this rank's share of the loss of the
    whole sequence (Megatron-Core's, over its tp_cp group): the counts over every rank's tokens,
    T = local tokens x t x cp, the scores of this rank's."""
    scores, chosen = _balance_scores(logits, cfg)
    counts, tokens = _summed(chosen, logits.shape[0], [tp_group, cp_group])
    return _switch_loss(scores, counts, tokens, cfg)


def sequence_load_balancing_loss(
    logits: torch.Tensor,
    cfg: GPTConfig,
    seq: int,
    tp_group: ProcessGroup | None = None,
    cp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """DeepSeek's sequence-wise loss (seq_aux_loss), times --moe-aux-loss-coeff: the Switch
    loss of each of the b sequences of [s b, E] ``logits`` (tokens in [s, b] order, ``seq`` =
    s) over its own s tokens, averaged over the b sequences. Under tensor and context
    parallelism this rank's share, as load_balancing_loss's: each sequence's counts over the
    t x cp ranks' parts of it, s = local x t x cp."""
    scores, chosen = _balance_scores(logits, cfg)
    b = logits.shape[0] // seq
    # [s, b E]: each column one expert of one sequence (Megatron-Core's reshape).
    counts, tokens = _summed(chosen.reshape(seq, -1), seq, [tp_group, cp_group])
    return _switch_loss(scores.reshape(seq, -1), counts, tokens, cfg) / b


def global_load_balancing_loss(
    logits: torch.Tensor, cfg: GPTConfig, router: Router, tp_group: ProcessGroup | None = None
) -> torch.Tensor:
    """Megatron-Core's global_aux_loss, times --moe-aux-loss-coeff: this rank's share of the
    Switch loss whose counts are every tensor-, data- and context-parallel rank's
    (``router.global_group``: the data x context-parallel ranks), averaged over the
    iteration's microbatches so far (``router``'s running sums, started again each
    iteration by finish_iteration), T = local tokens x t x dp x cp, the scores this rank's."""
    scores, chosen = _balance_scores(logits, cfg)
    counts, tokens = _summed(chosen, logits.shape[0], [tp_group, router.global_group])
    router.global_tokens_per_expert += counts
    router.global_steps += 1
    mean = router.global_tokens_per_expert / router.global_steps  # fp32, as Megatron-Core's
    return _switch_loss(scores, mean, tokens, cfg)


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean of logsumexp(logits)^2 over tokens, times ``coeff``."""
    return torch.square(torch.logsumexp(logits, dim=-1)).mean() * coeff


class _CountTokens(torch.autograd.Function):
    """``probs`` as they are; in backward (once per microbatch, recomputed or not), ``counts``
    are added to ``router``'s local_tokens_per_expert."""

    @staticmethod
    def forward(
        ctx: Any, probs: torch.Tensor, counts: torch.Tensor, router: Router
    ) -> torch.Tensor:
        ctx.counts, ctx.router = counts, router
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.router.local_tokens_per_expert += ctx.counts
        return grad, None, None


class Router(nn.Module):
    """Logits over the experts, [T, E], from a weight [E, h] without bias (Megatron-Core's
    TopKRouter's gate), in --moe-router-dtype where given; with --moe-router-enable-expert-bias
    the expert bias and the tokens counted since its last update (both fp32, as Megatron-Core
    keeps them; not in the state dict: megart's checkpoints carry the bias apart, see
    expert_bias_rows)."""

    def __init__(self, cfg: GPTConfig, layer: int, sequence_parallel: bool = False) -> None:
        super().__init__()
        shape = (cfg.num_experts, cfg.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape))
        draw = weight_init(cfg, cfg.init_std, shape)
        draw(self.weight.data, generator(cfg.seed, layer, "router"))
        # Replicated, and applied to this rank's slice of the sequence: its gradient is
        # completed over the group with the norms' (tensor_parallel.sync_sequence_parallel_grads).
        self.weight.sequence_parallel = sequence_parallel
        self.dtype = _DTYPES[cfg.moe_router_dtype]
        self.layer, self.rate = layer, cfg.moe_router_bias_update_rate
        on = cfg.moe_router_enable_expert_bias
        zeros = torch.zeros(cfg.num_experts, dtype=torch.float32) if on else None
        self.register_buffer("expert_bias", zeros, persistent=False)
        self.register_buffer(
            "local_tokens_per_expert", None if zeros is None else zeros.clone(), persistent=False
        )
        # global_aux_loss's running counts over the iteration's microbatches, and the group
        # they are summed over besides the tensor-parallel one (set_global_group).
        balance = cfg.moe_router_load_balancing_type == "global_aux_loss"
        running = torch.zeros(cfg.num_experts) if balance and cfg.moe_aux_loss_coeff > 0 else None
        self.register_buffer("global_tokens_per_expert", running, persistent=False)
        self.global_steps = 0
        self.global_group: ProcessGroup | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:  # the input's dtype (autocast's, where it runs)
            return F.linear(tokens, self.weight)
        with torch.autocast(tokens.device.type, enabled=False):
            return F.linear(tokens.to(self.dtype), self.weight.to(self.dtype))

    def bias(self) -> torch.Tensor | None:
        """The expert bias in fp32 (a model cast to another dtype cast its buffers too)."""
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
            self.local_tokens_per_expert = self.local_tokens_per_expert.float()
        return self.expert_bias

    def counted(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``probs``, counting the tokens ``chosen`` sends each expert when their gradient
        comes (training only)."""
        return _CountTokens.apply(probs, chosen.sum(dim=0).float(), self)


def biased_routers(chunks: list[nn.Module]) -> list[Router]:
    """The routers with an expert bias in ``chunks``, in layer order."""
    return [
        m
        for chunk in chunks
        for m in chunk.modules()
        if isinstance(m, Router) and m.bias() is not None
    ]


def set_global_group(chunks: list[nn.Module], group: ProcessGroup | None) -> None:
    """The data x context-parallel ``group`` global_aux_loss's counts are summed over."""
    for m in (m for chunk in chunks for m in chunk.modules()):
        if isinstance(m, Router):
            m.global_group = group


def finish_iteration(chunks: list[nn.Module], grid: Any) -> None:
    """The routers' part of Megatron-Core's finalize_model_grads, once per iteration after the
    gradients are complete: the expert biases' update; global_aux_loss's running counts
    started again."""
    update_expert_bias(chunks, grid)
    for m in (m for chunk in chunks for m in chunk.modules()):
        if isinstance(m, Router) and m.global_tokens_per_expert is not None:
            m.global_tokens_per_expert.zero_()
            m.global_steps = 0


def update_expert_bias(chunks: list[nn.Module], grid: Any) -> None:
    """Megatron-Core's aux-loss-free update, once per iteration: every router's token counts
    summed over the tensor- and data x context-parallel ranks, each bias moved by the update
    rate, up where its expert got fewer tokens than the mean and down where more (sign of the
    difference, zero at the mean), in fp32; the counts then start again from zero."""
    routers = biased_routers(chunks)
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    for group in (grid.tp_group, grid.dp_cp_group):
        if group_size(group) > 1:
            dist.all_reduce(counts, group=group)
    offset = counts.sum(dim=-1, keepdim=True) / counts.shape[-1] - counts
    for router, row in zip(routers, offset, strict=True):
        router.expert_bias += torch.sign(row) * router.rate
        router.local_tokens_per_expert.zero_()


def expert_bias_rows(
    chunks: list[nn.Module], cfg: GPTConfig, pp_group: ProcessGroup, device: torch.device
) -> torch.Tensor:
    """Every layer's expert bias, [layers, E] fp32 (zero rows for dense layers), the same on
    every rank: each layer's row from the pipeline stage that holds it, summed over
    ``pp_group`` (every stage calls this; the others add zeros, exactly). What megart's
    checkpoints keep, so that any layout reads its own layers' rows back (load_expert_bias)."""
    # The multi-token prediction depths' layers (models.mtp) after the decoder's.
    layers = cfg.num_layers + (cfg.mtp_num_layers or 0)
    rows = torch.zeros(layers, cfg.num_experts, device=device)
    for router in biased_routers(chunks):
        rows[router.layer] = router.expert_bias
    if group_size(pp_group) > 1:
        dist.all_reduce(rows, group=pp_group)
    return rows.cpu()


def load_expert_bias(chunks: list[nn.Module], rows: torch.Tensor) -> None:
    """Sets each router's expert bias from expert_bias_rows' ``rows``."""
    for router in biased_routers(chunks):
        router.expert_bias.copy_(rows[router.layer])
