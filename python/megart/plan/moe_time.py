"""The work of a mixture-of-experts layer's MLP part (megart.models.moe) for timing.layer_work:
its matrix products by their sizes, its element-wise traffic and, split over t tensor-parallel
ranks (with sequence parallelism), the allgather dispatcher's collectives."""

from __future__ import annotations

from megart.models.config import GPTConfig

# Bytes per element of --moe-router-dtype (else the activations').
ROUTER_BYTES = {"fp32": 4, "fp64": 8}


def moe_mlp_shapes(
    cfg: GPTConfig, tokens: float, tp: int = 1
) -> list[tuple[float, float, float, float]]:
    """(rows, cols, inner, count) of an MoE layer's forward products over ``tokens`` tokens (the
    whole sequence's) on one of ``tp`` ranks: the router's over this rank's slice (tokens / t
    x h by h x E), and each expert's MLP over the tokens routed to it, gathered from every
    rank, f/t of its width (column- then row-parallel), taken as balanced (k tokens / E each:
    an estimate, the routing being the data's; unequal counts run the same FLOPs in thinner or
    thicker products)."""
    h, e, fm = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size / tp
    rows = tokens * cfg.moe_router_topk / e
    ups = 2 if cfg.activation == "swiglu" else 1
    return [(tokens / tp, e, h, 1), (rows, fm, h, e * ups), (rows, h, fm, e)]


def moe_elementwise(cfg: GPTConfig, tp: int = 1) -> float:
    """Element-wise elements read and written per token by an MoE layer's MLP part on one of
    ``tp`` ranks: its k experts' activations over f/t (as a dense MLP's of moe_ffn_size, plus
    the routing weight's product: read and write f/t) and the tokens' gather to and sum from
    their experts (read and write h each way, every rank all of them); the router's softmax
    over E, small beside them, is left out."""
    fm, k = cfg.moe_ffn_size / tp, cfg.moe_router_topk
    activation = (3 if cfg.activation == "swiglu" else 2) * fm + 2 * fm
    return k * (activation + 4 * cfg.hidden_size)


Collectives = list[tuple[str, float]]  # (timing.BUS_FACTOR's kind, the whole buffer's bytes)


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
    return forward, backward
