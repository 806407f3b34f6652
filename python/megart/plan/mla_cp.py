"""Multi-latent attention (plan.mla_memory) under context parallelism: what each --cp-comm-type
changes in the saves mla_attention_bytes counts per token (traced with torch's saved-tensor
hooks on cp2 ranks, tests/test_plan_mla_cp.py), and the widths its exchanges carry
(plan.context_parallel's counts at MLA's widths).

Per own token, n = heads/t, qd = qk_head_dim + qk_pos_emb_head_dim, v = v_head_dim:

    ring (p2p)      values narrower than the queries travel zero-padded to qd
                    (models.ring_attention): the kernel keeps the padded values (n qd) and its
                    padded output (n qd) in place of the key/value up-projection's output (the
                    values were a view of it: n (qk_head_dim + v)) and the narrow output (n v);
                    nothing changes at v = qd or under selective recomputation (the ring runs
                    inside its checkpoint, which keeps q, k and v as given).
    all-to-all      the kernel keeps the exchanged values (n v, new tensors) in place of the
                    up-projection's output; under selective recomputation the checkpoint keeps
                    q, k and v before the exchange: no change.
    all-gather      the kernel keeps the gathered keys and values, n (qd + v) per token of
                    the whole sequence, in place of the own keys (n qd) and the up-projection's
                    output; under selective recomputation MLA's checkpoint runs the gathers
                    inside it (models.mla's core) and keeps q, k and v as given: no change.
"""

from __future__ import annotations

from megart.models.config import GPTConfig


def _widths(cfg: GPTConfig, tp: int) -> tuple[float, int, int, int]:
    """(heads per rank, the queries' and keys' width qd, qk_head_dim, v_head_dim)."""
    qd = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    return cfg.num_attention_heads / tp, qd, cfg.qk_head_dim, cfg.v_head_dim


def mla_cp_elements(cfg: GPTConfig, tp: int, cp: int, recompute: str | None) -> tuple[float, float]:
    """Elements per token that --cp-comm-type adds to one MLA's saves (see the module's doc):
    (per own token, may be negative; per token of the whole sequence)."""
    if cp <= 1 or not cfg.multi_latent_attention:
        return 0.0, 0.0
    n, qd, qk, v = _widths(cfg, tp)
    up = n * (qk + v)  # the key/value up-projection's output, which a view of v kept
    if recompute == "selective":
        return 0.0, 0.0
    if cfg.cp_comm_type == "all_gather":
        return -(n * qd + up), n * (qd + v)
    if cfg.cp_comm_type == "a2a":
        return n * v - up, 0.0
    if v < qd:  # the ring's padded values and output
        return 2 * n * qd - up - n * v, 0.0
    return 0.0, 0.0


def cp_kv_widths(cfg: GPTConfig) -> tuple[int, int, int]:
    """(the key/value heads, the keys' and the values' width per head) as context parallelism
    exchanges them (plan.context_parallel): MLA's keys per query head, qd and v_head_dim
    wide; an ordinary attention's query groups, head_dim both."""
    if cfg.multi_latent_attention:
        _, qd, _, v = _widths(cfg, 1)
        return cfg.num_attention_heads, qd, v
    return cfg.query_groups, cfg.head_dim, cfg.head_dim
