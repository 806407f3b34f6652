"""Multi-latent attention (--multi-latent-attention, megart.models.mla) in megart plan's memory
count: its parameters on one tensor-parallel rank, and what one layer's attention saves per
token (traced with torch's saved-tensor hooks on tp1 and tp2 ranks, with and without sequence
parallelism, --q-lora-rank and --qk-layernorm, fp32 and bf16).

Per token, t tensor-parallel ranks, heads/t heads a rank (n of them), qd = qk_head_dim +
qk_pos_emb_head_dim, v = v_head_dim, in the activations' dtype unless said otherwise:

    queries as attention takes them         n qd     (rope's output joined to the rest: a copy)
    keys as attention takes them            n qd     (the shared rope part repeated per head)
    the key/value up-projection's output    n (qk_head_dim + v)  (the values are a view of it)
    attention's output and the projection's input  2 n v  (the second only under selective
                                                    recomputation of core_attn)
    each latent (kv: kv_lora_rank, its down-projection kv_lora_rank + qk_pos_emb_head_dim
    wide; with --q-lora-rank the queries' q_lora_rank, as wide as its down-projection), by
    what its up-projection and its norm keep (mla_latent_bytes).

The down-projections' outputs are gathered whole on every rank; the attention's input (the
norm's output) is the layer's count already (activations.norm_outputs), as is flash
attention's fp32 log-sum-exp (heads/t a token). A GPU runs widths v != qd in its
memory-efficient kernel, which saves what flash attention saves (its inputs, output and
log-sum-exp): a model, unverified on a GPU (a CPU runs torch's math kernel then, keeping
s x s scores, so the tests give v = qd).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megart.models.config import GPTConfig

if TYPE_CHECKING:  # plan.activations counts MLA's saves with these
    from megart.plan.activations import Precision


def _norm(cfg: GPTConfig, size: int) -> list[int]:
    """A norm's tensors over ``size`` channels (parameters._norm's rule)."""
    return [size] if cfg.normalization == "rmsnorm" else [size, size]


def mla_tensors(cfg: GPTConfig, tp: int) -> list[int]:
    """Element counts of one MLA's parameters on one of ``tp`` ranks, in models.mla's
    registration order: the queries' projection (or q_down_proj, q_up_proj), kv_down_proj,
    kv_up_proj (each column-parallel: rows / t), the output projection (row-parallel) and its
    bias, then --qk-layernorm's latent norms, whole on every rank."""
    h, n, t = cfg.hidden_size, cfg.num_attention_heads, tp
    qd = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    out = [n * qd // t * h] if rq is None else [rq // t * h, n * qd // t * rq]
    out += [
        (rkv + cfg.qk_pos_emb_head_dim) // t * h,
        n * (cfg.qk_head_dim + cfg.v_head_dim) // t * rkv,
    ]
    out += [h * n * cfg.v_head_dim // t, *([h] if cfg.bias else [])]
    if cfg.qk_layernorm:
        out += (_norm(cfg, rq) if rq is not None else []) + _norm(cfg, rkv)
    return out


def mla_latent_bytes(
    cfg: GPTConfig, r: int, down: int, tp: int, sp: bool, prec: Precision
) -> float:
    """Bytes per token one latent of ``r`` channels keeps, its down-projection ``down`` wide
    (r, or r + the rope part). Without --qk-layernorm the up-projection keeps its input: the
    gathered down-projection's output (a view of all ``down`` channels), or under sequence
    parallelism the latent gathered again from the ranks' slices (r). With the norm, the
    up-projection keeps the norm's output (r, gathered whole under sequence parallelism), and
    the norm, over this rank's slice of the sequence under sequence parallelism: LayerNorm its
    input and fp32 mean and rstd; RMSNorm an fp32 rsqrt and its normalised product, and its
    input (fp32 runs) or an fp32 copy of it (16-bit runs). A kept input is the down-projection's
    whole output ([s, b, down], a view; the slice of a narrower latent is a copy of r on s/t)."""
    split = sp and tp > 1
    own = 1 / tp if split else 1.0
    if not cfg.qk_layernorm:
        return (r if split else down) * prec.other
    out = r * prec.other  # the up-projection's input
    if cfg.normalization != "rmsnorm" or prec.other == 4:  # activations.qk_norm_keeps_input
        out += (r * own if split and down != r else down) * prec.other
    else:  # RMSNorm's fp32 copy of the 16-bit input
        out += r * own * 4
    if cfg.normalization == "rmsnorm":
        out += own * (4 + r * prec.other)
    else:
        out += own * 2 * 4
    return out


def mla_attention_bytes(
    cfg: GPTConfig, tp: int, sp: bool, recompute: str | None, prec: Precision
) -> float:
    """Bytes per token one MLA keeps besides its input and the core's log-sum-exp (see the
    module's doc); ``recompute`` "selective": the core recomputed (its output not kept)."""
    n = cfg.num_attention_heads / tp
    qd, v = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    heads = n * (2 * qd + cfg.qk_head_dim + v + v * (1 if recompute == "selective" else 2))
    rkv = cfg.kv_lora_rank
    latents = mla_latent_bytes(cfg, rkv, rkv + cfg.qk_pos_emb_head_dim, tp, sp, prec)
    if cfg.q_lora_rank is not None:
        latents += mla_latent_bytes(cfg, cfg.q_lora_rank, cfg.q_lora_rank, tp, sp, prec)
    return heads * prec.other + latents


def mla_weight_grad_elements(cfg: GPTConfig, tp: int) -> float:
    """Elements per token (of the whole sequence) one MLA keeps between a zero-bubble
    schedule's I and W (activations.weight_grad_bytes' attention part): each deferred
    projection's input X and output gradient dY (megart.tensor_parallel.weight_grad). X: the
    attention's input once (the query and key/value down-projections share one column-parallel
    entry: one gather, one saved copy), each latent once as its up-projection reads it (r: a
    view of the gathered down-projection's output, the sequence gathered again, or its norm's
    output), the output projection's heads v / t. dY: each column-parallel product's rows / t
    (the queries' projection, or q_down_proj's and q_up_proj's; kv_down_proj's with the rope
    part; kv_up_proj's) and the row-parallel projection's h."""
    h, n, t = cfg.hidden_size, cfg.num_attention_heads, tp
    qd = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
    x = h + rkv + (rq or 0) + n * cfg.v_head_dim / t
    queries = n * qd / t + (rq / t if rq is not None else 0.0)
    dy = queries + (rkv + cfg.qk_pos_emb_head_dim) / t
    dy += n * (cfg.qk_head_dim + cfg.v_head_dim) / t + h
    return x + dy
