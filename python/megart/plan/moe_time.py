"""The work of a mixture-of-experts layer's MLP part (megart.models.moe) for timing.layer_work:
its matrix products by their sizes and its element-wise traffic."""

from __future__ import annotations

from megart.models.config import GPTConfig


def moe_mlp_shapes(cfg: GPTConfig, tokens: float) -> list[tuple[float, float, float, float]]:
    """(rows, cols, inner, count) of an MoE layer's forward products over ``tokens`` tokens:
    the router's (tokens x h by h x E), and each expert's MLP over the tokens routed to it,
    taken as balanced (k tokens / E each: an estimate, the routing being the data's; unequal
    counts run the same FLOPs in thinner or thicker products)."""
    h, e, fm = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size
    rows = tokens * cfg.moe_router_topk / e
    ups = 2 if cfg.activation == "swiglu" else 1
    return [(tokens, e, h, 1), (rows, fm, h, e * ups), (rows, h, fm, e)]


def moe_elementwise(cfg: GPTConfig) -> float:
    """Element-wise elements read and written per token by an MoE layer's MLP part: its k
    experts' activations (as a dense MLP's of moe_ffn_size, plus the routing weight's product:
    read and write f) and the tokens' gather to and sum from their experts (read and write h
    each way); the router's softmax over E, small beside them, is left out."""
    fm, k = cfg.moe_ffn_size, cfg.moe_router_topk
    activation = (3 if cfg.activation == "swiglu" else 2) * fm + 2 * fm
    return k * (activation + 4 * cfg.hidden_size)
