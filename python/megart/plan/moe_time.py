"""The work of a mixture-of-experts layer's MLP part (megart.models.moe) for timing.layer_work:
its matrix products by their sizes, its element-wise traffic and, split over t tensor-parallel
ranks (with sequence parallelism), the allgather dispatcher's collectives; spread over ep
expert-parallel ranks (models.expert_exchange), its all-to-alls. Shared experts
(--moe-shared-expert-intermediate-size S) add a dense MLP of width S over every token: its
products, its activation and its sum with the experts' output (with --moe-shared-expert-gate
the gate's h-long product, sigmoid and scaling over this rank's slice; its weight's gradient
joins the norms' sequence-parallel all-reduce, h elements, left out), and at t > 1 a dense MLP's
gather and reduce-scatter each way (exposed, as the dispatcher's); whole on every rank under
expert parallelism.

The router's options cost no time here: group-limited routing's group scores and mask, the
expert bias's add and gather, and the balancing losses' counts are over E per token beside the
layer's h-wide work; seq_aux_loss's tensor-parallel all-reduce of counts is b E rather than E
elements, global_aux_loss adds one of E over the data x context-parallel ranks a layer and
microbatch, and the bias's update one of layers x E a step: latency-bound and left out.

Selective recomputation replays in the backward (timing.layer_work): --recompute-modules moe
the layer's whole forward (router, dispatcher's collectives, all-to-alls, experts, shared
experts), shared_experts the shared experts' alone (within moe's replay when both are named:
torch's nested checkpoint runs them once more, not twice).

Expert parallelism is timed for balanced routing: every rank's experts get k T token copies a
microbatch (each expert k T / E from each rank's T tokens, ep k T / E from the group), each
rank sends (ep - 1) / ep of its own k T copies away and gets as many. Beside tensor
parallelism (t > 1, sequence parallelism) T is the tokens gathered over the t ranks: each
tensor-parallel rank exchanges all of them with the ranks of its own tensor-parallel rank (t
times the bytes of Megatron-Core's all-to-all dispatcher, which splits them), its experts f/t
wide, and the dispatcher's gathers and reduce-scatter run around the exchange as at ep = 1;
under context parallelism T is the rank's s/cp part of the sequence. Uneven routing runs the
same FLOPs but makes the rank whose experts get the most the slowest, and its all-to-alls
longer; neither is modelled. The group is ep ranks t apart (expert_group_near), inside a
node when it fits in one, else split over nodes: each all-to-all
is posted at once (one latency), its pieces to the rank's node mates over NVLink and to the
others over the rank's own rail at the same time (context_parallel.a2a_seconds' model), the
group's worst-placed rank setting the pace (expert_group_near).
"""

from __future__ import annotations

import functools

from megart.models.config import GPTConfig
from megart.plan.context_parallel import all_to_all_seconds
from megart.plan.hardware import GPUProfile

# Bytes per element of --moe-router-dtype (else the activations').
ROUTER_BYTES = {"fp32": 4, "fp64": 8}


def moe_mlp_shapes(
    cfg: GPTConfig, tokens: float, tp: int = 1, ep: int = 1
) -> list[tuple[float, float, float, float]]:
    """(rows, cols, inner, count) of an MoE layer's forward products over ``tokens`` tokens (the
    whole sequence's) on one of ``tp`` ranks: the router's over this rank's slice (tokens / t
    x h by h x E), and each expert's MLP over the tokens routed to it, gathered from every
    rank, f/t of its width (column- then row-parallel), taken as balanced (k tokens / E each:
    an estimate, the routing being the data's; unequal counts run the same FLOPs in thinner or
    thicker products). Under expert parallelism (``ep`` ranks) the rank's E/ep experts, each
    over the ep k T / E copies the group's ranks send it (T gathered over t), balanced."""
    h, e, fm = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size / tp
    rows = tokens * cfg.moe_router_topk / e * ep
    ups = 2 if cfg.activation == "swiglu" else 1
    local = e // ep
    routed = [(tokens / tp, e, h, 1), (rows, fm, h, local * ups), (rows, h, fm, local)]
    return routed + shared_mlp_shapes(cfg, tokens, tp)


def shared_mlp_shapes(cfg: GPTConfig, tokens: float, tp: int = 1) -> list[tuple[float, ...]]:
    """(rows, cols, inner, count) of the shared experts' products (a dense MLP of width S =
    --moe-shared-expert-intermediate-size, column- then row-parallel) over the whole
    sequence's ``tokens`` (gathered) on one of ``tp`` ranks: none without shared experts.
    Under expert parallelism every rank runs them whole on its own tokens."""
    width = cfg.moe_shared_expert_intermediate_size
    if not width:
        return []
    h, s = cfg.hidden_size, width / tp
    mlp = [(tokens, s, h, 2 if cfg.activation == "swiglu" else 1), (tokens, h, s, 1)]
    # --moe-shared-expert-gate: x . w over this rank's slice (replicated [1, h] weight)
    return mlp + ([(tokens / tp, 1, h, 1)] if cfg.moe_shared_expert_gate else [])


def shared_elementwise(cfg: GPTConfig, tp: int = 1, summed: bool = True) -> float:
    """Element-wise elements read and written per token by the shared experts on one of
    ``tp`` ranks: their activation over S/t (as a dense MLP's) and, ``summed``, their output's
    sum with the experts' (read two, write one, over this rank's slice: sequence parallelism
    at t > 1)."""
    width = cfg.moe_shared_expert_intermediate_size
    if not width:
        return 0.0
    activation = (3 if cfg.activation == "swiglu" else 2) * width / tp
    # The gate: its sigmoid (read and write 1) and the product scaling the output (read h + 1,
    # write h), over this rank's slice.
    gate = (2 * cfg.hidden_size + 3) / tp if cfg.moe_shared_expert_gate else 0.0
    return activation + gate + (3 * cfg.hidden_size / tp if summed else 0.0)


def replayed_forward(
    cfg: GPTConfig,
    modules: tuple[str, ...],
    products: list[float],
    element_seconds: float,
    tp: int,
    ep: int,
    comm: tuple[float, float],
    ep_forward: float,
) -> tuple[float, float, float]:
    """Seconds selective recomputation adds to an MoE layer's backward (the module's doc):
    (all of them, of which tensor-parallel collectives, of which all-to-alls). ``products``:
    the seconds of moe_mlp_shapes' products, in order; ``element_seconds``: of one element per
    token read or written; ``comm``: the forward's tensor-parallel collectives, all of them and
    the shared experts' alone; ``ep_forward``: its all-to-alls."""
    if "moe" in modules:
        elements = moe_elementwise(cfg, tp, ep) * element_seconds
        return sum(products) + elements + comm[0] + ep_forward, comm[0], ep_forward
    shared = len(shared_mlp_shapes(cfg, 1.0))
    if "shared_experts" in modules and shared:  # the sum with the experts' runs once
        elements = shared_elementwise(cfg, tp, summed=False) * element_seconds
        return sum(products[-shared:]) + elements + comm[1], comm[1], 0.0
    return 0.0, 0.0, 0.0


def moe_elementwise(cfg: GPTConfig, tp: int = 1, ep: int = 1) -> float:
    """Element-wise elements read and written per token by an MoE layer's MLP part on one of
    ``tp`` ranks: its k experts' activations over f/t (as a dense MLP's of moe_ffn_size, plus
    the routing weight's product: read and write f/t) and the tokens' gather to and sum from
    their experts (read and write h each way, every rank all of them); the router's softmax
    over E, small beside them, is left out. Under expert parallelism (``ep`` > 1) each copy
    is gathered and placed once more (read and write h each) on the rank whose expert runs it,
    balanced: as many as it sends."""
    fm, k = cfg.moe_ffn_size / tp, cfg.moe_router_topk
    activation = (3 if cfg.activation == "swiglu" else 2) * fm + 2 * fm
    moves = 4 if ep == 1 else 8
    return k * (activation + moves * cfg.hidden_size) + shared_elementwise(cfg, tp)


Collectives = list[tuple[str, float]]  # (collectives.BUS_FACTOR's kind, the whole buffer's bytes)


def moe_collectives(cfg: GPTConfig, tokens: float, act: int) -> tuple[Collectives, Collectives]:
    """The tensor-parallel collectives of an MoE layer's MLP part for one microbatch of
    ``tokens`` tokens (the whole sequence's), forward and backward, as models.moe runs them
    (Megatron-Core's allgather dispatcher): forward, the tokens (h, ``act`` bytes), their
    routing weights (E, the router's dtype or ``act``) and choices (E, one byte each) gathered
    from every rank's slice, the experts' partial outputs reduce-scattered back (h, summed in
    the routing weights' dtype), and with --moe-aux-loss-coeff the E token counts all-reduced
    (fp32 at least); backward, the outputs' gradient gathered and the tokens' and weights'
    reduce-scattered. None of them runs beside a product (counted exposed)."""
    h, e = cfg.hidden_size, cfg.num_experts
    r = ROUTER_BYTES.get(cfg.moe_router_dtype or "", act)
    forward = [
        ("all_gather", tokens * h * act),
        ("all_gather", tokens * e * r),
        ("all_gather", tokens * e),
        ("reduce_scatter", tokens * h * r),
    ]
    if cfg.moe_aux_loss_coeff > 0:
        forward.append(("all_reduce", e * max(r, 4)))
    backward = [
        ("all_gather", tokens * h * r),
        ("reduce_scatter", tokens * h * act),
        ("reduce_scatter", tokens * e * r),
    ]
    shared_forward, shared_backward = shared_collectives(cfg, tokens, act)
    return forward + shared_forward, backward + shared_backward


def shared_collectives(cfg: GPTConfig, tokens: float, act: int) -> tuple[Collectives, Collectives]:
    """The shared experts' tensor-parallel collectives (t > 1, sequence parallelism), as a
    dense MLP's: forward its input gathered and its output reduce-scattered (h, ``act``
    bytes), backward the output's gradient gathered and the input's reduce-scattered; none
    without shared experts."""
    if not cfg.moe_shared_expert_intermediate_size:
        return [], []
    one = tokens * cfg.hidden_size * act
    return [("all_gather", one), ("reduce_scatter", one)], [
        ("all_gather", one),
        ("reduce_scatter", one),
    ]


def expert_exchanges(cfg: GPTConfig, tokens: float, act: int) -> tuple[list[float], list[float]]:
    """The all-to-alls of an MoE layer spread over expert-parallel ranks for one microbatch of
    ``tokens`` tokens on a rank, forward and backward, as models.expert_exchange runs them:
    each the bytes of the rank's whole send buffer (its pieces for every rank, its own
    included), routing balanced. Forward: the counts (E int64: how many copies each of the
    receiver's experts gets), the k T token copies (h, ``act`` bytes: the norm's output), their
    routing weights (the router's dtype, else ``act``) and the experts' outputs back (h,
    ``act``: the experts' products' dtype); backward the same three reversed, gradients of the
    outputs, the weights and the tokens. The dispatch and the combine carry all but a
    k T E-th of the bytes."""
    copies = tokens * cfg.moe_router_topk
    h = cfg.hidden_size
    r = ROUTER_BYTES.get(cfg.moe_router_dtype or "", act)
    forward = [cfg.num_experts * 8, copies * h * act, copies * r, copies * h * act]
    backward = [copies * h * act, copies * r, copies * h * act]
    return forward, backward


@functools.lru_cache(maxsize=1024)
def expert_group_near(
    gpus_per_node: int, dp: int, pp: int, ep: int, tp: int = 1, cp: int = 1
) -> int:
    """The fewest ranks of its own expert-model-parallel group that any rank has in its node,
    itself counted. megart's grid places ranks tp-cp-dp-pp, and a group is the ``ep`` ranks of
    one tensor-parallel rank and stage at consecutive places d in the dp x cp group (cp
    innermost: parallel.experts): global ranks r + tp (d + dp cp stage), tp apart. A searched
    t divides the node's GPUs, so every tensor-parallel rank's groups sit alike."""
    fewest, ranks = ep, dp * cp
    for stage in range(pp):
        for start in range(0, ranks, ep):
            first = stage * ranks + start
            nodes = [tp * (first + i) // gpus_per_node for i in range(ep)]
            fewest = min(fewest, min(nodes.count(n) for n in set(nodes)))
    return fewest


def expert_exchange_seconds(
    cfg: GPTConfig, tokens: float, ep: int, near: int, gpu: GPUProfile, act: int
) -> tuple[float, float]:
    """Forward and backward seconds of one MoE layer's all-to-alls (expert_exchanges) for one
    microbatch of ``tokens`` tokens on a rank of ``ep``, ``near`` of them in the worst-placed
    rank's node (expert_group_near), counted exposed (nothing runs beside them: the experts
    wait for their tokens, the sum for their outputs)."""
    forward, backward = expert_exchanges(cfg, tokens, act)
    return (
        sum(all_to_all_seconds(n, ep, near, gpu) for n in forward),
        sum(all_to_all_seconds(n, ep, near, gpu) for n in backward),
    )
