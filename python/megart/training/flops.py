"""FLOPs of one training iteration, as Megatron-LM counts them today (its training.py
num_floating_point_operations): the SC21 paper's count with the attention scores and the
scores x values products over the causal half of the s x s matrix only (the half a causal
mask keeps), and the logits over the padded vocabulary. The paper's own count
(``causal=False``, Narayanan et al., appendix):

    with full activation recomputation:  96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    without (the usual MFU numerator):   72 B s l h^2 (1 + s/(6h) + V/(12 l h))

B global batch (sequences), s sequence length, l layers, h hidden size, V vocabulary.

The paper assumes an MLP of 4h, GeLU and multi-head attention; iteration_flops counts the
matmuls for any MLP size f, for SwiGLU (three h x f matrices instead of two) and for
grouped-query attention (K and V projections to g key/value heads of size d = h / heads, kv =
g d wide instead of h; with --kv-channels d the query heads are q = heads x d wide, which
replaces h in the query and output projections and the core, as Megatron's
query_projection_size), and reduces exactly to the formulas above for f = 4h, GeLU, kv = h and
q = h.
A matmul of an (m x k) by a (k x n) matrix is 2 m k n FLOPs. One layer's forward:

    Q, K, V projections      2 B s h (h + 2 kv)      (6 B s h^2 for multi-head attention)
    scores Q K^T             2 B s^2 h      (the whole s x s matrix, as the paper counts;
    scores x values          2 B s^2 h       Megatron since 2025, and megart: half of each)
    output projection        2 B s h^2
    MLP                      4 B s h f      (GeLU: two matrices; SwiGLU: 6 B s h f)

and the logits 2 B s h V. Backward is twice the forward (input and weight gradients), and full
recomputation runs the forward of each layer it replays once more (not the logits'): every layer
under --recompute-method uniform, the first N of each model chunk under block
(:func:`replayed_in_chunks`). Megatron-LM's count leaves recomputation out whatever the flags;
megart keeps the paper's convention for TFLOP/s (what runs, the recomputed forward included) and
counts the model alone for MFU.

Mixture-of-experts layers (--num-experts; --moe-layer-freq picks which) are counted as Megatron-LM
counts them: each token's MLP products are those of its --moe-router-topk experts, k MLPs of
--moe-ffn-hidden-size (4 B s h f_moe k forward, 6 B s h f_moe k with SwiGLU), whichever experts
they are, so the count does not depend on the routing. Like Megatron-LM's, the count leaves out
the router's product (2 B s h E forward per MoE layer, E experts): a model-FLOP convention, not
what runs (tests/test_flops.py adds it to match torch's counter). Full recomputation replays a
MoE layer's experts with the rest of it; --recompute-modules mlp replays dense MLPs only (megart,
as Megatron-Core, does not checkpoint an MoE layer's experts as "mlp").

Multi-latent attention (--multi-latent-attention, models.mla) replaces the q/k/v and output
projections and the core by its own products (mla_widths): its query, down- and up-projections,
output projection, and a core whose scores are qk_head_dim + qk_pos_emb_head_dim wide a head and
whose values v_head_dim; Megatron-LM's count adds its latents' norms, which megart leaves out.

Selective recomputation (``selective``) runs every layer's attention core once more: both of its
products where the core is one call (Megatron-LM's checkpoint of it, flash and memory-efficient
kernels), which is what megart plan counts. megart train does not count it in its TFLOP/s: with
torch's math kernel (``--attention-backend unfused``, and the CPU) the checkpoint stops once the
scores x values product's inputs are back, so only the scores product runs again, and which
kernel runs is torch's choice. With --recompute-modules mlp (``mlp_again``) every layer's MLP
runs its forward once more, which megart plan and megart train both count, whole, as a replayed
layer's forward is counted (torch's checkpoint may skip the last product: see test_flops);
layernorm recomputes no product. Korthikanti et al.'s hardware FLOPs under selective recomputation
have s/(3h) where the model's count has s/(6h): the core's forward and backward once more, three
times the replay counted here.

Multi-token prediction's D depths (--mtp-num-layers, models.mtp) add D dense layers, D eh_proj
products (2 B s 2h h forward each) and D more logits, as Megatron-LM counts them; Megatron-LM
also counts the depths' three norms as 3h multiply-adds per token, which megart, counting
products only, leaves out (18 B s h D FLOPs an iteration). Full uniform recomputation replays
each depth's forward but its logits (Megatron-Core checkpoints the depth so), which the run's
count adds.
"""

from __future__ import annotations

from collections.abc import Iterable

from megart.models.config import GATED, GPTConfig
from megart.models.recompute import recomputed_spans

# Dense bf16 peak per GPU, FLOP/s (datasheets); MFU is reported against the one that applies.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def iteration_flops(
    batch: int,
    seq: int,
    layers: int,
    hidden: int,
    vocab: int,
    recompute: bool = False,
    ffn_hidden: int | None = None,
    swiglu: bool = False,
    kv_hidden: int | None = None,
    causal: bool = True,
    replayed: int | None = None,
    selective: bool = False,
    query_hidden: int | None = None,
    mlp_again: bool = False,
    moe_layers: int = 0,
    routed_hidden: int = 0,
    replayed_moe: int | None = None,
    projections: int | None = None,
    core_width: int | None = None,
) -> int:
    """Model FLOPs of one iteration (forward and backward, plus, when ``recompute``, the
    recomputed forward of ``replayed`` of the ``layers``: all of them by default; with
    ``selective``, every layer's attention core once more), for an MLP
    of ``ffn_hidden`` (default 4 h), GeLU or ``swiglu``, and keys and values ``kv_hidden``
    wide (query groups x head size; default h, multi-head). An exact integer: in floating point
    the paper's formula and this count could differ by rounding. ``causal`` counts the
    attention core over the causal half (Megatron's count, B s^2 h per layer and product less
    than the paper's, which ``causal=False`` gives). ``query_hidden``: the query heads' width
    (heads x head size; default h), which replaces h in the query projection, the attention
    core and the output projection, as Megatron's query_projection_size does (--kv-channels).
    ``mlp_again``: every dense layer's MLP forward once more (--recompute-modules mlp).
    ``moe_layers``: how many of the ``layers`` are mixture-of-experts layers, whose MLP
    products are those of an MLP ``routed_hidden`` wide (--moe-ffn-hidden-size x
    --moe-router-topk: each token's experts); ``replayed_moe``: how many of the replayed
    layers are (None: every MoE layer when every layer is replayed, none when no layer is).
    ``projections``: each token's multiply-adds in the attention's projections (default
    h (q + 2 kv) + q h); ``core_width``: the widths of the scores and scores x values products
    together, per query and key (default 2 q): multi-latent attention's (mla_widths)."""
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    f = 4 * h if ffn_hidden is None else ffn_hidden
    kv = h if kv_hidden is None else kv_hidden
    q = h if query_hidden is None else query_hidden
    # The scores and values products run over every query head (keys and values repeated).
    linear = h * (q + 2 * kv) + q * h if projections is None else projections
    width = 2 * q if core_width is None else core_width  # Q K^T and scores x V
    core = (b * s * s if causal else 2 * b * s * s) * width
    attention = 2 * b * s * linear + core
    mlp = (3 if swiglu else 2) * 2 * b * s * h * f
    moe = (3 if swiglu else 2) * 2 * b * s * h * routed_hidden
    logits = 2 * b * s * h * v
    again = (l if replayed is None else replayed) if recompute else 0
    if not 0 <= again <= l:
        raise ValueError(f"replayed={replayed}: full recomputation replays 0 to {l} layers")
    if not 0 <= moe_layers <= l:
        raise ValueError(f"moe_layers={moe_layers}: 0 to {l} of the layers")
    if replayed_moe is None:
        if 0 < again < l and moe_layers:
            raise ValueError("which replayed layers are MoE layers: give replayed_moe")
        replayed_moe = moe_layers if again == l else 0
    if not 0 <= replayed_moe <= min(again, moe_layers):
        raise ValueError(f"replayed_moe={replayed_moe}: 0 to {min(again, moe_layers)}")
    if (selective or mlp_again) and recompute:
        raise ValueError("selective and full recomputation are exclusive")
    dense = l - moe_layers
    # Forward, backward (twice the forward), and the replayed layers' forward (or, selective,
    # every layer's attention core, and every dense layer's MLP) once more.
    passes = (3 * l + again) * attention + (3 * dense + again - replayed_moe) * mlp
    passes += (3 * moe_layers + replayed_moe) * moe
    return passes + l * core * selective + dense * mlp * mlp_again + 3 * logits


def model_flops(
    cfg: GPTConfig,
    batch: int,
    recompute: bool = False,
    tp: int = 1,
    causal: bool = True,
    replayed: int | None = None,
    selective: bool = False,
    mlp_again: bool = False,
    replayed_moe: int | None = None,
) -> int:
    """iteration_flops of the model ``cfg`` describes, ``batch`` sequences per iteration, with
    the logits over the vocabulary padded for tensor-parallel size ``tp`` (as Megatron);
    ``replayed``: the layers ``recompute`` runs again (None: all; :func:`replayed_in_chunks`
    counts them for a run's chunks); ``selective``: the attention cores replayed;
    ``mlp_again``: the MLPs replayed; ``replayed_moe``: how many of the ``replayed`` are
    mixture-of-experts layers (:func:`replayed_moe_in_chunks`)."""
    depths = mtp_flops(cfg, batch, tp, causal, recompute and cfg.recompute_method == "uniform")
    return depths + iteration_flops(
        batch,
        cfg.seq_length,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.padded_vocab_size(tp),
        recompute,
        cfg.ffn_size,
        cfg.activation in GATED,
        cfg.query_groups * cfg.head_dim,
        causal,
        replayed,
        selective,
        cfg.query_size,
        mlp_again,
        moe_layer_count(cfg),
        routed_width(cfg),
        replayed_moe,
        *mla_widths(cfg),
    )


def mla_widths(cfg: GPTConfig) -> tuple[int | None, int | None]:
    """Multi-latent attention's (projections, core_width) for iteration_flops (None, None
    without it): its products, as Megatron-LM's count has them (training.py's MLA terms), but
    for the norms' q_lora_rank + kv_lora_rank per token, which megart, counting products only,
    leaves out as it does every norm's. Per token: the queries' h x heads (qk + pos) (or h x
    q_lora_rank and q_lora_rank x heads (qk + pos)), the down-projection's h x (kv_lora_rank +
    pos), the up-projection's kv_lora_rank x heads (qk + v), the output's heads v x h; the
    scores over qk + pos channels a head, the values' v."""
    if not cfg.multi_latent_attention:
        return None, None
    h, n, rkv, rq = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    qd, v = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    queries = h * n * qd if rq is None else rq * (h + n * qd)
    keys_values = h * (rkv + cfg.qk_pos_emb_head_dim) + rkv * n * (cfg.qk_head_dim + v)
    return queries + keys_values + n * v * h, n * qd + n * v


def mtp_flops(cfg: GPTConfig, batch: int, tp: int, causal: bool, replay: bool) -> int:
    """The FLOPs of multi-token prediction's depths in an iteration of ``batch`` sequences (0
    without): a layer (the last decoder layer's kind, dense or MoE, as Megatron-LM counts it),
    the eh_proj product and the logits each, forward and backward; with ``replay``, each
    depth's forward but its logits once more."""
    d = cfg.mtp_num_layers or 0
    if not d:
        return 0
    b, s, h = batch, cfg.seq_length, cfg.hidden_size
    projections, core_width = mla_widths(cfg)  # a depth's layer is the model's kind
    moe = d if cfg.is_moe_layer(cfg.num_layers) else 0
    layers = iteration_flops(b, s, d, h, 0, replay, cfg.ffn_size, cfg.activation in GATED,
                             cfg.query_groups * cfg.head_dim, causal, None, False,
                             cfg.query_size, moe_layers=moe, routed_hidden=routed_width(cfg),
                             projections=projections, core_width=core_width)  # fmt: skip
    proj, logits = 2 * b * s * 2 * h * h, 2 * b * s * h * cfg.padded_vocab_size(tp)
    return layers + d * ((3 + replay) * proj + 3 * logits)


def routed_width(cfg: GPTConfig) -> int:
    """Each token's expert width in an MoE layer (0 for a dense model): its top k experts' and
    the shared experts' (Megatron's)."""
    if not cfg.num_experts:
        return 0
    return cfg.moe_ffn_size * cfg.moe_router_topk + (cfg.moe_shared_expert_intermediate_size or 0)


def moe_layer_count(cfg: GPTConfig) -> int:
    """How many of the model's layers are mixture-of-experts layers (0 for a dense model)."""
    if cfg.num_experts is None:
        return 0
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def replayed_layers(cfg: GPTConfig, layers: int) -> list[bool]:
    """Whether full recomputation replays each of a chunk's ``layers`` layers, as the chunk
    runs them (recomputed_spans): none without full recomputation."""
    if cfg.recompute_granularity != "full":
        return [False] * layers
    spans = recomputed_spans(layers, cfg.recompute_method, cfg.recompute_num_layers)
    return [again for start, stop, again in spans for _ in range(start, stop)]


def replayed_in_chunks(cfg: GPTConfig, chunks: Iterable[int]) -> int:
    """How many layers full recomputation replays in model chunks of ``chunks`` layers each
    (every chunk of every pipeline rank, for the whole model's count): replayed_layers'."""
    return sum(sum(replayed_layers(cfg, layers)) for layers in chunks)


def replayed_moe_in_chunks(cfg: GPTConfig, chunks: Iterable[range]) -> int:
    """Of the layers full recomputation replays in model chunks holding ``chunks`` (model
    layer indices), how many are mixture-of-experts layers."""
    return sum(
        again and cfg.is_moe_layer(i)
        for chunk in chunks
        for i, again in zip(chunk, replayed_layers(cfg, len(chunk)), strict=True)
    )


def parameter_count(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)): weights, biases, norms, embeddings."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))
