"""A mixture-of-experts layer (Megatron's --num-experts): in place of a layer's MLP, a linear
router picks moe_router_topk of num_experts MLPs for each token and sums their outputs weighted
by its routing weights, as Megatron-Core's MoELayer with its TopKRouter and SequentialMLP. The
router, its routing (DeepSeek-V3's expert bias and group-limited routing included) and the
load-balancing losses' values are models.moe_router's; the expert bias's update is the
trainer's, once per iteration (moe_router.update_expert_bias).

Training adds two losses to the model's, through their gradients only (the reported loss is the
language model's): the Switch Transformer's load-balancing loss, E * sum_i f_i P_i times
--moe-aux-loss-coeff over each microbatch (f_i: the share of the k T choices that went to
expert i, P_i: its mean router probability; under seq_aux_loss the same over each sequence,
averaged over the microbatch's, logged as ``seq_load_balancing_loss``), and ST-MoE's z-loss,
the mean squared logsumexp of the router's logits times --moe-z-loss-coeff. Like Megatron-
Core's MoEAuxLossAutoScaler, each is attached to a tensor of the forward and seeds its own
gradient in backward, scaled as the language model's loss is (1/m of the batch, times fp16's
loss scale: AuxLossScale), so pipeline stages need not carry them to the last stage.

Under tensor parallelism (with sequence parallelism, which Megatron-Core requires for MoE
training: moe_checks.check_moe_tensor_parallel) each expert's MLP is split over the group as the
dense MLP is, and the layer works as Megatron-Core's allgather token dispatcher with the expert
tensor-parallel size equal to the tensor-parallel size: the router, replicated, routes this
rank's slice of the sequence; the tokens, their routing weights and choices are gathered over
the group (backward: the weights' and tokens' gradients reduce-scattered, as each rank's are
partial sums over its part of the experts' width); every rank runs every expert's part on all
tokens, and the partial outputs are reduce-scattered back to the slices (backward: gathered).
The router's gradient is a partial sum over the slices, completed with the norms' (its weight
is marked ``sequence_parallel``). The load-balancing loss counts each expert's tokens over the
group and divides by all of them (local x t), weighing only this rank's scores, and the z-loss
coefficient is divided by t, as Megatron-Core's: the ranks' losses then add up to the
one-process loss of the whole sequence.

Under context parallelism (cp_group: each sequence split over cp ranks, megart.models.
context_parallel) routing and the experts are token-wise and need no exchange; only the losses'
statistics do, over t x cp as Megatron-Core's tp_cp group: the counts summed over both groups,
T = local x t x cp, the z-loss coefficient divided by t cp. The ranks' losses again add up to
the sequence's; but gradients are averaged over dp x cp (the language model's loss is each cp
rank's mean over its own tokens, and their average the sequence's mean), which would leave the
auxiliary losses at 1/cp of their sum: their gradients are seeded cp times the language model's
factor, as Megatron-Core's schedules set MoEAuxLossAutoScaler's scale to loss scale x cp / m.

Under expert parallelism (ep_group: models.expert_exchange) each rank builds only its
num_experts / ep experts, global indices ep_rank x E/ep onwards, drawn as one process draws
those experts and named by their global index (``experts.E.``); the router and the losses are
each rank's own, as without it. With tensor parallelism as well (the expert tensor-parallel size
equal to it, Megatron's default) each of them is this rank's tensor-parallel shard: the tokens
gathered over the tensor-parallel group are exchanged with the ranks of the same tensor-parallel
rank (parallel.experts), run through the shards, exchanged back and reduce-scattered as above.
With context parallelism each rank exchanges its own tokens; an expert-parallel group may span
context-parallel ranks.

Shared experts (--moe-shared-expert-intermediate-size S, Megatron-Core's SharedExpertMLP without
its gate): one more models.mlp.MLP of width S that every token goes through, applied to the
layer's input and split over the tensor-parallel group as the dense MLP is (under sequence
parallelism its input gathered from, and its output reduce-scattered to, the ranks' slices),
its output added to the experts' sum. Under expert parallelism it is an ordinary parameter,
the same on every expert-parallel rank and averaged over all data- and context-parallel ranks.
With --moe-shared-expert-gate (SharedExpertMLP's gate) their output is first multiplied, token
by token, by sigmoid(x . w), w one [1, h] weight applied to the layer's input as the router is
(replicated; under sequence parallelism to this rank's slice, its gradient completed over the
group with the norms').
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megart.distributed import ProcessGroup
from megart.models.config import GPTConfig
from megart.models.expert_exchange import expert_parallel_mlp, rows_by_expert
from megart.models.init import generator, weight_init
from megart.models.mlp import MLP
from megart.models.moe_checks import check_expert_parallel_layer, check_moe_tensor_parallel
from megart.models.moe_grouped import grouped_experts, pack
from megart.models.moe_router import (  # noqa: F401 (route, Router: their names here too)
    Router,
    global_load_balancing_loss,
    load_balancing_loss,
    route,
    sequence_load_balancing_loss,
    z_loss,
)
from megart.models.recompute import checkpointed
from megart.models.router_noise import NoiseKey, StraightThrough, normal, token_noise, uniform
from megart.tensor_parallel import gather_from_sequence_region, reduce_scatter_to_sequence_region
from megart.tensor_parallel._group import group_size
from megart.tensor_parallel.column_entry import enter_column_region


class AuxLossScale:
    """What the training loss's gradient is scaled by in this run (loss scale / microbatches),
    set by megart.pipeline's engine before each one (GPTChunk.set_loss_scale): the auxiliary
    losses' gradients get the same factor. Also the losses' values for the log, by name
    (``load_balancing_loss``, ``z_loss``: unweighted) and layer, summed over the microbatches,
    recorded when their gradients are seeded, so once per microbatch even where recomputation
    runs a layer's forward twice; the trainer takes them after each iteration
    (megart.training.moe_metrics). And the key of the router's noise (models.router_noise),
    which the trainer and the engine set."""

    def __init__(self) -> None:
        self.value = 1.0
        self.tracked: dict[str, dict[int, torch.Tensor]] = {}
        self.noise = NoiseKey()

    def track(self, name: str, value: torch.Tensor, layer: int = 0) -> None:
        """Adds ``value`` to what ``name`` has gathered at ``layer`` since the last take."""
        layers = self.tracked.setdefault(name, {})
        old = layers.get(layer)
        layers[layer] = value if old is None else old + value

    def take(self) -> dict[str, dict[int, torch.Tensor]]:
        """What was tracked since the last take, by name and layer (then cleared)."""
        tracked, self.tracked = self.tracked, {}
        return tracked


class _SeedGradient(torch.autograd.Function):
    """``x`` as it is; in backward, ``loss``'s gradient is ``scale.value`` times ``factor``
    (Megatron-Core's MoEAuxLossAutoScaler), and ``loss`` / ``divisor`` is tracked as ``name``
    of ``layer`` (the loss without its coefficient)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        loss: torch.Tensor,
        scale: AuxLossScale,
        factor: float,
        name: str,
        divisor: float,
        layer: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale, ctx.tracker, ctx.name, ctx.divisor = scale.value * factor, scale, name, divisor
        ctx.layer = layer
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (loss,) = ctx.saved_tensors
        ctx.tracker.track(ctx.name, loss.detach().double() / ctx.divisor, ctx.layer)
        return grad, torch.full_like(loss, ctx.scale), None, None, None, None, None


class SharedExpertGate(nn.Module):
    """[..., h] -> [..., 1]: sigmoid(x . w) for each token, from a weight [1, h] (Megatron-Core's
    SharedExpertMLP ``gate_weight``, drawn as its other weights), which scales the shared
    experts' output."""

    def __init__(self, cfg: GPTConfig, layer: int, sequence_parallel: bool = False) -> None:
        super().__init__()
        shape = (1, cfg.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape))
        draw = weight_init(cfg, cfg.init_std, shape)
        draw(self.weight.data, generator(cfg.seed, layer, "shared_expert_gate"))
        # As the router's: replicated, applied to this rank's slice of the sequence.
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class MoE(nn.Module):
    """[s, b, h] -> [s, b, h]: each token through its top-k experts (models.mlp.MLP, each
    moe_ffn_size wide), their outputs summed with the routing weights, plus the shared
    experts' output where there are any."""

    def __init__(
        self,
        cfg: GPTConfig,
        layer: int,
        loss_scale: AuxLossScale,
        tp_group: ProcessGroup | None = None,
        sequence_parallel: bool = False,
        cp_group: ProcessGroup | None = None,
        ep_group: ProcessGroup | None = None,
    ) -> None:
        """``tp_group``: the experts split over it (with ``sequence_parallel``, required
        then); ``cp_group``: context parallelism's, over which the losses' statistics go;
        ``ep_group``: expert parallelism's, over which the experts are spread."""
        super().__init__()
        self.tp, self.cp = group_size(tp_group), group_size(cp_group)
        check_moe_tensor_parallel(cfg, self.tp, sequence_parallel)
        self.cfg, self.loss_scale, self.tp_group = cfg, loss_scale, tp_group
        self.cp_group, self.layer = cp_group, layer
        self.router = Router(cfg, layer, sequence_parallel)
        self.ep_group = ep_group if group_size(ep_group) > 1 else None
        if self.ep_group is None:
            self.experts: nn.Module = nn.ModuleList(self._expert(e) for e in range(cfg.num_experts))
        else:  # this rank's share, under their global indices
            check_expert_parallel_layer(cfg, self.ep_group.size())
            local = cfg.num_experts // self.ep_group.size()
            first = self.ep_group.rank() * local
            self.experts = nn.ModuleDict(
                {str(e): self._expert(e) for e in range(first, first + local)}
            )
            for p in self.experts.parameters():  # averaged over expert-data parallelism
                p.expert_parallel = True
        width = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = (
            None
            if width is None
            else MLP(cfg, layer, tp_group, sequence_parallel, ffn=width, name="shared_")
        )
        self.recompute_shared = cfg.recomputes("shared_experts")
        self.grouped = False  # --moe-grouped-gemm: see group()
        self.shared_expert_gate = (
            SharedExpertGate(cfg, layer, sequence_parallel) if cfg.moe_shared_expert_gate else None
        )

    def _expert(self, e: int) -> MLP:
        """Expert ``e`` (global index) of this layer, drawn from its own stream."""
        cfg, ffn = self.cfg, self.cfg.moe_ffn_size
        return MLP(cfg, self.layer, self.tp_group, False, ffn=ffn, name=f"expert{e}_", expert=True)

    def group(self) -> None:
        """Runs the experts as one grouped product per projection from now on
        (--moe-grouped-gemm, models.moe_grouped), their weights packed into one stack each."""
        pack(list(self.experts.values() if self.ep_group is not None else self.experts))
        self.grouped = True

    def _grouped(self, x: torch.Tensor, scale: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts on their rows of ``x`` (sorted by expert, ``counts`` each), grouped."""
        experts = self.experts.values() if self.ep_group is not None else self.experts
        return grouped_experts(list(experts), x, counts, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x)
        if self.shared_experts is None:
            return out
        if self.recompute_shared and torch.is_grad_enabled():  # --recompute-modules shared_experts
            return out + checkpointed(self._shared, None, x)
        return out + self._shared(x)  # Megatron-Core's postprocess: routed + shared

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' output for ``x``, times their gate's where there is one (as
        Megatron-Core's SharedExpertMLP, which its "shared_experts" recomputation replays
        whole)."""
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = shared * self.shared_expert_gate(x)
        return shared

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for ``x``."""
        cfg, group = self.cfg, self.tp_group
        tokens = x.reshape(-1, x.shape[-1])  # [s b, h], or this rank's [s/t b, h]
        logits = self._logits(x, tokens)
        training = self.training and torch.is_grad_enabled()
        if training and cfg.moe_z_loss_coeff:
            # Each rank's mean over its slice: divided by t cp, the ranks' add up to the mean.
            coeff = cfg.moe_z_loss_coeff / (self.tp * self.cp)
            logits = self._attach(logits, z_loss(logits, coeff), "z_loss", coeff)
        bias = self.router.bias()
        probs, chosen = route(logits, cfg, bias)
        if training and bias is not None:  # the tokens each expert got, for the bias's update
            probs = self.router.counted(probs, chosen)
        if training and cfg.moe_aux_loss_coeff > 0:
            probs = self._balance(probs, logits, x.shape[0])
        if self.tp > 1:  # every rank's tokens (in sequence order), as the dispatcher gathers
            with torch.no_grad():
                chosen = gather_from_sequence_region(chosen.to(torch.uint8), group).bool()
            probs = gather_from_sequence_region(probs, group)
            # In autocast's type, where the experts' products would cast them.
            tokens = gather_from_sequence_region(enter_column_region(tokens, None, False)[0], group)
        if self.ep_group is not None:  # (under tp, the group's tokens, with same-tp-rank peers)
            experts = [(int(e), m) for e, m in self.experts.items()]
            grouped = self._grouped if self.grouped else None
            out = expert_parallel_mlp(tokens, probs, chosen, experts, self.ep_group, grouped)
        elif self.grouped:  # one grouped product per projection over the rows by expert
            rows = rows_by_expert(chosen)
            counts = [len(r) for r in rows]
            order = torch.cat(rows)
            # Each expert's rows as views of order: the weights' gathers keep order's storage,
            # one row index per copy as the loop keeps (plan.moe_memory), not a second one.
            parts = order.split(counts)
            scale = torch.cat([probs[r, e] for e, r in enumerate(parts)])
            y = self._grouped(tokens[order], scale, counts)
            out = tokens.new_zeros(tokens.shape, dtype=y.dtype).index_add(0, order, y)
        else:
            out = tokens.new_zeros(0)
            # Every expert runs, on no tokens where none chose it, so that each weight gets a
            # gradient (zero then), as Megatron-Core's SequentialMLP.
            each = zip(self.experts, rows_by_expert(chosen), strict=True)
            for e, (expert, rows) in enumerate(each):
                y = expert(tokens[rows], scale=probs[rows, e])
                if e == 0:
                    out = tokens.new_zeros(tokens.shape, dtype=y.dtype)
                out = out.index_add(0, rows, y)
        if self.tp > 1:  # each rank's part of every expert's output: summed, sliced back
            # Summed in the routing weights' type, as Megatron-Core's combine sums them.
            out = reduce_scatter_to_sequence_region(out.to(probs.dtype), group).to(out.dtype)
        return out.view(x.shape)

    def _balance(self, probs: torch.Tensor, logits: torch.Tensor, seq: int) -> torch.Tensor:
        """``probs``, with the load-balancing loss of --moe-router-load-balancing-type attached
        (over the microbatch, each of its sequences of ``seq`` tokens here, or the
        iteration's microbatches so far on every data-parallel rank)."""
        cfg, coeff = self.cfg, self.cfg.moe_aux_loss_coeff
        if cfg.moe_router_load_balancing_type == "seq_aux_loss":
            loss = sequence_load_balancing_loss(logits, cfg, seq, self.tp_group, self.cp_group)
            return self._attach(probs, loss, "seq_load_balancing_loss", coeff)
        if cfg.moe_router_load_balancing_type == "global_aux_loss":
            loss = global_load_balancing_loss(logits, cfg, self.router, self.tp_group)
            return self._attach(probs, loss, "global_load_balancing_loss", coeff)
        loss = load_balancing_loss(logits, cfg, self.tp_group, self.cp_group)
        return self._attach(probs, loss, "load_balancing_loss", coeff)

    def _attach(self, x: torch.Tensor, loss: torch.Tensor, name: str, coeff: float) -> torch.Tensor:
        """``x``, with ``loss`` (``coeff`` times the loss ``name``) seeding its gradient."""
        # Times cp: the gradients' average over the cp ranks is then the sum of their losses.
        return _SeedGradient.apply(x, loss, self.loss_scale, self.cp, name, coeff, self.layer)

    def _noise(self, x: torch.Tensor, kind: str, like: torch.Tensor, draw: Any) -> torch.Tensor:
        """Noise ``kind`` for the tokens of [s, b, h] ``x`` (router_noise), shaped as [s b, n]
        ``like`` and of its dtype."""
        where = (self.cfg.seed, self.layer, kind)
        width = like.shape[-1]
        shape = (x.shape[0], x.shape[1], width)
        groups = (self.tp_group, self.cp_group)
        return token_noise(self.loss_scale.noise, where, shape, groups, like, draw).view(-1, width)

    def _logits(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The router's logits for ``tokens`` ([s b, h] of ``x``): its input jittered in
        training (--moe-input-jitter-eps), its logits replaced by random ones with
        --moe-router-force-load-balancing (in evaluation too, as Megatron-Core's)."""
        cfg = self.cfg
        eps = cfg.moe_input_jitter_eps
        if eps is not None and self.training:
            tokens = tokens * self._noise(x, "input_jitter", tokens, uniform(eps))
        logits = self.router(tokens)
        if cfg.moe_router_force_load_balancing:
            noise = self._noise(x, "force_load_balancing", logits, normal)
            logits = StraightThrough.apply(logits, noise)
        return logits
