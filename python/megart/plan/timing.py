"""Time of one training iteration's parts, from FLOPs, bytes and the profile's figures.

Per microbatch and layer on one GPU (t tensor-parallel ranks):
- matrix products (q/k/v, output projection, MLP, attention scores and values): FLOPs at
  peak x e(m), e(m) = gemm_efficiency_max x m / (m + gemm_half_dim), m the product's smallest
  dimension (the two fitted constants). A thin product re-reads its operands for every output
  tile, so it runs nearer the memory bound: the attention core's products have the head size
  as one dimension (64-128), and h / t shrinks with t. Backward is two products per forward one
  with the same dimensions, except flash attention's core, which runs half the products under
  a causal mask and recomputes the scores in its backward (five products per forward two);
- element-wise work (norms, residual adds, activation function, and with unfused attention the
  softmax and dropout of the s x s scores) at HBM bandwidth: bytes counted per token, replicated
  over t unless sequence parallel;
- tensor-parallel collectives over NVLink: 2 all-reduces of b s h 16-bit elements forward and 2
  backward (as reduce-scatter + all-gather pairs with sequence parallelism; the same bytes),
  2(t-1)/t of them on the wire, plus 2 more forward when full recomputation replays a layer;
  an MoE layer's experts replace the MLP's pair with its dispatcher's (plan.moe_time), exposed,
  and spread over expert-parallel ranks add their all-to-alls (exposed; ep_comm); its
  --recompute-modules moe / shared_experts replay their forward (moe_time.replayed_forward).

With context parallelism (cp ranks, megart.models.context_parallel) a rank holds s/cp tokens of
each sequence: every per-token term above counts those. Under all_gather its
attention all-gathers keys and values (16-bit, b s kv/t each, kv = groups x head size) over the
context-parallel group forward and reduce-scatters their gradients backward (the all-gathers
again under full recomputation; selective recomputation's checkpoint starts after them), and
each of its two query chunks attends to the keys up to its own end, causal aligned to the lower
right: flash kernels skip the blocks above the diagonal, so a rank runs 1/cp of the causal
scores (Megatron's load-balanced split gives each rank the same count), as one process would
per sequence of s/cp queries against s keys, halved. Under the ring (--cp-comm-type p2p,
megart.models.ring_attention) each rank passes its keys and values on cp - 1 times forward, and
again with their gradients backward, the forward's passes replayed under either recomputation
(the ring runs inside selective's checkpoint; plan.context_parallel, ring_seconds), and
computes each step's block with flash kernels (torch's, as the all-gather's attention): its own
block causal, then cp - 1 half blocks, (s/cp)^2 / 2 each, the same 1/cp of the causal scores as
above, at the same efficiency, with flash's backward (FLASH_BACKWARD); no scores are written to
memory. (Until the ring ran flash kernels its blocks were explicit products, (cp + 1) / (2 cp)
of the rank's (s/cp) x s scores with a softmax over them: 14.6 times slower on an H200 at s =
16384, cp 2, bench/RESULTS.md.) Under the all-to-all (--cp-comm-type a2a,
megart.models.all_to_all_attention, plan.context_parallel) each rank runs plain causal
attention over the whole sequence for heads/(t cp) of the heads (flash kernels: the causal
half; --attention unfused: torch's math kernel, all s x s products and the same score bytes per
rank as cp = 1 at heads/t over s/cp queries), and its all-to-alls (four forward, four backward,
and replayed: all four under full recomputation, the three before the kernel under selective)
are counted exposed.

A layer with a sliding window (--window-size, the layers --window-attn-skip-freq picks; the
others as above) runs explicit masks, which no flash kernel takes: over the whole sequence (one
process, each a2a rank's heads) megart's query tiles score window_share of the s x s products,
about (T + left) / s (all of them where tiling would not pay), under all_gather one mask over
all of a rank's (s/cp) x s; at the attention core's efficiency above, the backward recomputing
the scores as flash's (or keeping them, unfused, with their bytes scaled alike), plus one read
per pass of the cached bias slices its calls take (window_bias_reads; what the caches hold is
memory: plan.window_memory). Under the ring each rank computes
the pieces of its blocks inside the window (models.ring_window, by the kernels that take a
bias: plan.ring_window_cost counts their products, a causal piece's half), timed as the
masked call above at the busiest rank's share of its (s/cp) x s products, plus one read of its
pieces' biases per pass as the documents' bias below; its exchanges are the ring's (every
block still travels).

Under --reset-attention-mask (documents in a sample; megart train refuses it with context
parallelism, megart plan with a window) every layer's attention is one masked call over all
s x s entries with the documents' bias (plan.documents), timed as a window's single masked call:
all the products at the core's efficiency, the backward recomputing the scores
(FLASH_BACKWARD), plus one read of the bias per pass (documents_mask_read). Model FLOPs
(training.flops) ignore the mask, as Megatron-LM's count does.
"""

from __future__ import annotations

from dataclasses import dataclass

from megart.models.config import GPTConfig
from megart.models.recompute import recomputed_modules
from megart.models.window import covers
from megart.models.window_masks import bias_row_stride
from megart.plan.attention_shares import CAUSAL_SHARE as CAUSAL_SHARE
from megart.plan.attention_shares import FLASH_BACKWARD as FLASH_BACKWARD
from megart.plan.attention_shares import cp_score_share as cp_score_share
from megart.plan.attention_shares import window_bias_reads, window_share
from megart.plan.collectives import (
    BACKWARD_MODES,
    BACKWARD_OVERLAP,
    collective_seconds,
    tp_backward_seconds,
)
from megart.plan.context_parallel import RingPasses, a2a_layer_seconds, kv_gathers, ring_passes
from megart.plan.hardware import GPUProfile
from megart.plan.mla_time import (
    mla_collectives,
    mla_column_shapes,
    mla_norm_elements,
    mla_output_score_value_widths,
)
from megart.plan.moe_time import (
    expert_exchange_seconds,
    moe_collectives,
    moe_elementwise,
    moe_mlp_shapes,
    replayed_forward,
    shared_collectives,
)
from megart.plan.ring_window_cost import ring_bias_reads, ring_window_share

ACT = 2  # bytes of a 16-bit activation element
GRAD_BYTES = 4  # the ring's dK/dV accumulators travel in fp32 (models.ring_attention)


def documents_mask_read(seq: int, b: int, gpu: GPUProfile) -> float:
    """Seconds to read --reset-attention-mask's bias once at HBM speed: b s x s 16-bit
    entries, rows padded to 16 (plan.documents). Each layer's masked kernel reads it forward
    and again backward (and in a replayed forward): counted once per pass, as if its heads
    shared each tile of it through the cache (a lower bound; unmeasured on a GPU)."""
    return b * seq * bias_row_stride(seq) * ACT / (gpu.hbm_gb_per_s * 1e9)


def ring_seconds(
    passes: RingPasses, bus_gb_per_s: float, gpu: GPUProfile
) -> tuple[float, float, float]:
    """Forward, backward and replayed seconds of one layer's ring exchange (--cp-comm-type
    p2p; plan.context_parallel.ring_passes): each pass a rank's block to the next rank while it
    receives the previous one's, 16-bit K/V or fp32 dK/dV (twice the bytes), one latency each.
    Counted as exposed: the ring posts each step's exchange before that step's products, but
    that it overlaps on a GPU is unmeasured."""
    latency = gpu.link_latency_us * 1e-6
    step = passes.block * ACT / (bus_gb_per_s * 1e9) + latency
    grad_step = passes.block * GRAD_BYTES / (bus_gb_per_s * 1e9) + latency
    backward = passes.backward * step + passes.grads * grad_step
    return passes.forward * step, backward, passes.replayed * step


@dataclass(frozen=True)
class Work:
    """Seconds of one microbatch's forward and backward (recomputation included) through some
    layers on one GPU, the share of it spent in tensor-parallel collectives, and the share of
    the backward that is weight-gradient products (what a zero-bubble schedule's W runs; the
    rest, its I, includes recomputation)."""

    forward: float
    backward: float
    tp_comm: float
    weight: float = 0.0
    cp_comm: float = 0.0  # context parallelism's key/value all-gathers and reduce-scatters
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (plan.moe_time)

    def __add__(self, other: Work) -> Work:
        return Work(
            self.forward + other.forward,
            self.backward + other.backward,
            self.tp_comm + other.tp_comm,
            self.weight + other.weight,
            self.cp_comm + other.cp_comm,
            self.ep_comm + other.ep_comm,
        )

    def __mul__(self, k: float) -> Work:
        return Work(
            self.forward * k,
            self.backward * k,
            self.tp_comm * k,
            self.weight * k,
            self.cp_comm * k,
            self.ep_comm * k,
        )


def gemm_seconds(
    rows: float, cols: float, inner: float, gpu: GPUProfile, count: float = 1
) -> float:
    """``count`` matrix products of (rows x inner) by (inner x cols) at the fitted efficiency
    for their smallest dimension."""
    flops = 2 * rows * cols * inner * count
    if flops <= 0:
        return 0.0
    smallest = min(rows, cols, inner)
    eff = gpu.gemm_efficiency_max * smallest / (smallest + gpu.gemm_half_dim)
    return flops / (gpu.peak_tflops * 1e12 * eff)


def layer_work(
    cfg: GPTConfig,
    b: int,
    tp: int,
    sp: bool,
    recompute: str | None,
    gpu: GPUProfile,
    unfused_attention: bool = False,
    tp_overlap: bool | str = False,
    cp: int = 1,
    cp_bus_gb_per_s: float | None = None,
    window: int | None = None,
    documents: bool = False,
    moe: bool = False,
    ep: int = 1,
    ep_near: int | None = None,
) -> Work:
    """One layer, one microbatch. ``tp_overlap``: True, each tensor-parallel collective runs
    during the matrix product next to it (Megatron-Core's --tp-comm-overlap),
    so only what outlasts that product is exposed; BACKWARD_OVERLAP or KEPT_INPUT_OVERLAP
    (megart's), only the column-parallel products' backward collectives do
    (tp_backward_seconds). ``cp``: context-parallel ranks,
    whose collectives run at ``cp_bus_gb_per_s`` (None: NVLink). ``window``: the layer's
    sliding window (earlier tokens each token sees; None: the whole causal past;
    window_share). ``documents``: under --reset-attention-mask's bias (without context
    parallelism or a window: megart train and plan refuse them with it; documents_mask_read).
    ``moe``: a mixture-of-experts layer: moe_mlp_shapes' products in place of the MLP's, its
    element-wise work (moe_elementwise) and at t > 1 its dispatcher's collectives
    (moe_collectives, exposed) in place of the MLP's; its experts spread over ``ep`` ranks
    (``ep_near`` of them in the worst-placed one's node; None: all), their all-to-alls
    (moe_time.expert_exchange_seconds, exposed)."""
    s, h, f, t = cfg.seq_length, cfg.hidden_size, cfg.ffn_size, tp
    modules = recomputed_modules(cfg, recompute)  # selective's --recompute-modules
    if recompute == "selective":  # attention's terms: as with its core recomputed, or without
        recompute = "selective" if "core_attn" in modules else None
    local = s // cp  # this rank's queries of each sequence
    tokens = local * b
    q, kv = cfg.query_size, cfg.query_groups * cfg.head_dim
    # (cols, inner) of each product over the tokens: q/k/v and the MLP's first product(s) are
    # column-parallel (cols split over t), the output projection and the MLP's last product
    # row-parallel (inner split).
    ups = 2 if cfg.activation == "swiglu" else 1
    shapes = [((q + 2 * kv) / t, h), (h, q / t)] + [(f / t, h)] * ups + [(h, f / t)]
    dense_times = [gemm_seconds(tokens, cols, inner, gpu) for cols, inner in shapes]
    mla = cfg.multi_latent_attention
    if mla:  # its column-parallel products as one entry (plan.mla_time), its projection's
        out_width, score_width, value_width = mla_output_score_value_widths(cfg)
        columns = sum(gemm_seconds(tokens, c, i, gpu) for c, i in mla_column_shapes(cfg, t))
        dense_times[:2] = [columns, gemm_seconds(tokens, h, out_width / t, gpu)]
    if moe:  # the router's and the experts' products in place of the MLP's
        experts = moe_mlp_shapes(cfg, tokens, t, ep)
        dense_times[2:] = [gemm_seconds(r, c, i, gpu, n) for r, c, i, n in experts]
    fwd_gemm = sum(dense_times)
    # Per head: scores (s x d by d x s), then scores x values (s x s by s x d).
    heads = b * cfg.num_attention_heads / t
    d = cfg.head_dim
    ring = cp > 1 and cfg.cp_comm_type == "p2p"
    a2a = cp > 1 and cfg.cp_comm_type == "a2a"
    rows = local
    if a2a:  # the whole sequence's queries of heads/(t cp) heads
        heads, rows = heads / cp, s
    score_d, value_d = (score_width, value_width) if mla else (d, d)
    core_gemm = gemm_seconds(rows, s, score_d, gpu, heads) + gemm_seconds(
        rows, value_d, s, gpu, heads
    )
    # A windowed layer's masked calls: the ring's pieces inside the window, else the tiles'.
    share = None
    if not covers(window, s):
        whole = a2a or cp == 1
        share = ring_window_share(s, cp, window) if ring else window_share(s, window, whole)
    if share is None and documents:  # one masked call over every s x s entry, as a window's
        share = 1.0
    if share is not None:
        core_gemm *= share
    elif ring or not unfused_attention:  # flash kernels (the ring's blocks too): causal half
        core_gemm *= CAUSAL_SHARE
    elif cp > 1 and not a2a:  # the explicit scores of each query chunk's keys (cp_score_share)
        core_gemm *= cp_score_share(cp)
    # Element-wise bytes per token, forward: two norms (read, write), two residual adds with
    # bias and dropout (read two, write one), the activation (GeLU: read f write f; SwiGLU:
    # read 2f write f); unfused attention: softmax and dropout over heads/t x s scores.
    replicated = 10 * h * (1 / t if sp else 1.0)
    # --qk-layernorm's norms read and write this rank's query and key heads.
    qk_norms = 2 * (q + kv) / t if cfg.qk_layernorm else 0.0
    if mla:  # the latents' norms instead, on this rank's slice under sequence parallelism
        qk_norms = mla_norm_elements(cfg) * (1 / t if sp else 1.0)
    mlp = (3 if cfg.activation == "swiglu" else 2) * f / t
    if moe:
        mlp = moe_elementwise(cfg, t, ep)
    # The ring's flash blocks write no scores. a2a's math kernel: s x s scores of heads/(t cp)
    # heads per rank, the same bytes as heads/t over the rank's s/cp queries counted here.
    unfused = unfused_attention and not ring
    scores = 4.5 * cfg.num_attention_heads / t * s * (share or 1.0) if unfused else 0.0
    hbm = gpu.hbm_gb_per_s * 1e9
    fwd_elem = tokens * (replicated + qk_norms + mlp) * ACT / hbm
    core_elem = tokens * scores * ACT / hbm
    bias_read = documents_mask_read(s, b, gpu) if documents else 0.0
    if not covers(window, s):  # the window's cached biases, read once per pass
        if ring:  # each piece's (ring_window_cost)
            bias_read = ring_bias_reads(s, cp, window) * ACT / hbm
        else:
            bias_read = window_bias_reads(s, window, a2a or cp == 1, cp) * ACT / hbm
    comm = comm_backward = 0.0
    moe_comm = (0.0, 0.0)  # an MoE layer's forward collectives: all, the shared experts'
    if t > 1:
        nbytes = tokens * h * ACT
        if sp:
            pair = ("reduce_scatter", "all_gather")  # one of each per all-reduce replaced
            one = sum(collective_seconds(k, nbytes, t, gpu.nvlink_bus_gb_per_s, gpu) for k in pair)
        else:
            one = collective_seconds("all_reduce", nbytes, t, gpu.nvlink_bus_gb_per_s, gpu)
        parts = 1 if moe else 2  # attention's and the MLP's; an MoE layer's experts: below
        comm = comm_backward = parts * one  # per pass
        if tp_overlap in BACKWARD_MODES:
            columns = [dense_times[0], sum(dense_times[2:-1])][:parts]  # q/k/v, the MLP's first
            regather = tp_overlap == BACKWARD_OVERLAP
            comm_backward = tp_backward_seconds(nbytes, t, sp, columns, gpu, regather)
        elif tp_overlap:
            # Four halves (all-gather or reduce-scatter) per pass, each beside one product.
            half = one / 2
            pairs = [dense_times[0], dense_times[1], sum(dense_times[2:-1]), dense_times[-1]]
            comm = comm_backward = sum(max(0.0, half - g) for g in pairs[: 2 * parts])
        if mla:  # its latents' gathers and gradients (plan.mla_time), exposed
            link = gpu.nvlink_bus_gb_per_s
            fwd, bwd = (sum(collective_seconds(kind, n, t, link, gpu) for kind, n in each)
                        for each in mla_collectives(cfg, tokens, t, sp, ACT))  # fmt: skip
            comm, comm_backward = comm + fwd, comm_backward + bwd
        if moe:
            link = gpu.nvlink_bus_gb_per_s
            passes = (*moe_collectives(cfg, tokens, ACT), shared_collectives(cfg, tokens, ACT)[0])
            fwd, bwd, shared = (sum(collective_seconds(kind, n, t, link, gpu) for kind, n in each)
                                for each in passes)  # fmt: skip
            comm, comm_backward, moe_comm = comm + fwd, comm_backward + bwd, (fwd, shared)
    # Context parallelism's exchanges (plan.context_parallel): forward, backward, and those that
    # recomputation replays in the backward.
    gather = scatter = replayed = 0.0
    bus = gpu.nvlink_bus_gb_per_s if cp_bus_gb_per_s is None else cp_bus_gb_per_s
    if a2a:
        gather, scatter, replayed = a2a_layer_seconds(cfg, b, t, cp, recompute, gpu, ACT)
    elif ring:
        gather, scatter, replayed = ring_seconds(ring_passes(cfg, b, t, cp, recompute), bus, gpu)
    elif cp > 1:  # K and V all-gathered forward, their gradients reduce-scattered backward
        g = kv_gathers(cfg, b, t, cp, recompute)
        kv = (g.keys * ACT, g.values * ACT)  # the two gathered tensors' bytes
        both = sum(collective_seconds("all_gather", n, cp, bus, gpu) for n in kv)
        gather, replayed = g.forward * both, g.replayed * both
        scatter = sum(collective_seconds("reduce_scatter", n, cp, bus, gpu) for n in kv)
        scatter *= g.backward
    ep_fwd, ep_bwd = (0.0, 0.0)
    if moe and ep > 1:
        ep_fwd, ep_bwd = expert_exchange_seconds(cfg, tokens, ep, ep_near or ep, gpu, ACT)
    forward = fwd_gemm + core_gemm + fwd_elem + core_elem + bias_read + comm + gather + ep_fwd
    # With the scores kept (unfused), the core's backward is two products per forward one, like
    # the dense ones'; flash attention keeps no scores and recomputes them.
    core_backward = 2 * core_gemm if unfused else FLASH_BACKWARD * core_gemm
    backward = 2 * (fwd_gemm + fwd_elem + core_elem) + core_backward + bias_read + scatter
    backward += comm_backward + ep_bwd
    tp_comm = comm + comm_backward
    ep_comm = ep_fwd + ep_bwd
    cp_comm = gather + scatter + replayed
    if recompute == "full":  # the layer's forward again, its exchanges as replayed counts them
        backward += forward - gather + replayed
        tp_comm += comm
        ep_comm += ep_fwd
    elif recompute == "selective":
        backward += core_gemm + core_elem + bias_read + replayed
    if "layernorm" in modules:  # both norms again (read, write), and with sequence
        # parallelism the gathered copies the products saved (mlp's checkpoint gathers its own)
        backward += tokens * 4 * h * (1 / t if sp else 1.0) * ACT / hbm
        again = (2 - ("mlp" in modules)) * (sp and t > 1)
        again *= collective_seconds("all_gather", tokens * h * ACT, t, gpu.nvlink_bus_gb_per_s, gpu)
        backward, tp_comm = backward + again, tp_comm + again
    if moe:  # --recompute-modules moe or shared_experts: their forward again (moe_time)
        again = replayed_forward(cfg, modules, dense_times[2:], tokens * ACT / hbm, t, ep,
                                 moe_comm, ep_fwd)  # fmt: skip
        backward, tp_comm, ep_comm = backward + again[0], tp_comm + again[1], ep_comm + again[2]
    if "mlp" in modules and not moe:  # the MLP's forward again (dense MLPs only, as
        # models.blocks checkpoints them), its entry's and exit's collectives too
        backward += sum(dense_times[2:]) + tokens * mlp * ACT / hbm + comm / 2
        tp_comm += comm / 2
    # dW = dY^T X of each dense product costs what its forward did; the attention core has no
    # weights, so both its backward products belong to I.
    return Work(forward, backward, tp_comm, fwd_gemm, cp_comm, ep_comm)


def logits_work(cfg: GPTConfig, b: int, tp: int, gpu: GPUProfile, cp: int = 1) -> Work:
    """The output layer and the vocab-parallel cross-entropy of the last stage, for this rank's
    s/``cp`` tokens. An untied output layer's weight gradient can wait for W; the tied one is
    the embedding's, which megart computes in I. The loss is element-wise, at HBM speed: the
    unfused one writes and reads fp32 logits each way; --cross-entropy-loss-fusion's kernels
    (megart.kernels.cross_entropy) read the 16-bit logits once forward and read and overwrite
    them with their gradient backward."""
    tokens = cfg.seq_length // cp * b
    vocab = cfg.padded_vocab_size(tp) // tp
    gemm = gemm_seconds(tokens, vocab, cfg.hidden_size, gpu)
    forward_bytes, backward_bytes = (2, 4) if cfg.cross_entropy_loss_fusion else (8, 8)
    hbm = gpu.hbm_gb_per_s * 1e9
    weight = gemm if cfg.untie_embeddings_and_output_weights else 0.0
    return Work(
        gemm + tokens * vocab * forward_bytes / hbm,
        2 * gemm + tokens * vocab * backward_bytes / hbm,
        0.0,
        weight,
    )
