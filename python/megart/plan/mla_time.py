"""Multi-latent attention's (megart.models.mla) work in plan.timing's layer model: its products'
shapes, its core's widths and its tensor-parallel collectives, as models.mla runs them (the
products' FLOPs are training.flops.mla_widths' count)."""

from __future__ import annotations

from megart.models.config import GPTConfig


def mla_column_shapes(cfg: GPTConfig, tp: int) -> list[tuple[float, float]]:
    """(cols, inner) of each column-parallel product over the tokens: the queries' projection
    (or q_down_proj and q_up_proj), kv_down_proj and kv_up_proj, their rows split over ``tp``
    (the output projection is row-parallel: heads v / t inner, as a dense layer's)."""
    h, n, t = cfg.hidden_size, cfg.num_attention_heads, tp
    qd = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    queries = [(n * qd / t, h)] if rq is None else [(rq / t, h), (n * qd / t, rq)]
    keys_values = [
        ((rkv + cfg.qk_pos_emb_head_dim) / t, h),
        (n * (cfg.qk_head_dim + cfg.v_head_dim) / t, rkv),
    ]
    return queries + keys_values


def mla_output_score_value_widths(cfg: GPTConfig) -> tuple[int, int, int]:
    """(the output projection's inner width heads x v_head_dim, the scores' width per head
    qk_head_dim + qk_pos_emb_head_dim, the values' v_head_dim)."""
    qd = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    return cfg.num_attention_heads * cfg.v_head_dim, qd, cfg.v_head_dim


def mla_norm_elements(cfg: GPTConfig) -> float:
    """Element-wise elements per token --qk-layernorm's latent norms read and write."""
    if not cfg.qk_layernorm:
        return 0.0
    return 2.0 * (cfg.kv_lora_rank + (cfg.q_lora_rank or 0))


def mla_collectives(
    cfg: GPTConfig, tokens: float, tp: int, sp: bool, act: int
) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The collectives one MLA runs beyond a dense attention's entry and exit, forward and
    backward, as (kind, bytes of the whole buffer): forward each down-projection's output
    gathered whole (kv_lora_rank + the rope part; q_lora_rank), and under sequence parallelism
    each latent gathered again over the sequence by its up-projection; backward the shared
    rope key part's gradient summed (all-reduce), and each latent's: all-reduced without
    sequence parallelism (a column-parallel product's replicated input), with it
    reduce-scattered by the up-projection's entry and gathered by the norms' slice."""
    if tp <= 1:
        return [], []
    latents = [cfg.kv_lora_rank] + ([cfg.q_lora_rank] if cfg.q_lora_rank is not None else [])
    downs = [cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim] + latents[1:]
    forward = [("all_gather", tokens * d * act) for d in downs]
    backward = [("all_reduce", tokens * cfg.qk_pos_emb_head_dim * act)]
    for r in latents:
        if sp:
            forward.append(("all_gather", tokens * r * act))
            backward += [("reduce_scatter", tokens * r * act), ("all_gather", tokens * r * act)]
        else:
            backward.append(("all_reduce", tokens * r * act))
    return forward, backward
