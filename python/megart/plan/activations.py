"""Activation memory of megart's GPT, per microbatch, from the tensors autograd saves.

Counted from megart's modules (and checked against torch's saved-tensor hooks on real ranks),
per layer, in elements of one microbatch (s tokens x b sequences), t tensor-parallel ranks:

    norm inputs (the residual stream)     2 h        (/t with sequence parallelism)
    norm outputs, the q/k/v and MLP inputs 2 h        (whole sequence even with sequence
                                                       parallelism: the gathered input is saved,
                                                       once for SwiGLU's gate and up projections)
    q, k, v as attention takes them       3 h/t      with one group per head and learned
                                                       positions: views of the fused q/k/v
                                                       output (see attention_elements for rope,
                                                       grouped queries and selective
                                                       recomputation)
    attention output (= projection input) h/t        (2 h/t with rope: see attention_elements)
    MLP                                   2 f/t (GeLU: its input and output), 4 f/t (SwiGLU:
                                          the gate's input, its SiLU, the up projection, the
                                          product)
    norm statistics (fp32)                2 per norm (LayerNorm's mean and rstd; RMSNorm's
                                          input in fp32 instead)
    attention log-sum-exp (fp32)          heads/t per token (flash attention saves no s x s
                                          matrix; with --attention unfused the scores are
                                          kept as Korthikanti et al. count them, 5 a s/t)
    hidden dropout masks (--hidden-dropout > 0) 2 h bytes (/t with sequence parallelism): a
                                          GPU's fused dropout keeps a bool mask per sub-layer
    and once per microbatch and chunk, rope's fp32 cos and sin tables, s rotary_dim elements
    (rope_table_bytes), shared by the chunk's layers.

Which kernel: the count is a GPU's with 16-bit activations (flash attention, torch's fused
dropout), which is what megart plan assumes. A CPU's kernels save the same tensors here but
for two: dropout keeps its mask in the activations' dtype (2 or 4 bytes, not 1), and attention
dropout > 0 sends a CPU to the math kernel, which keeps s x s matrices that flash attention
does not (a GPU's flash kernel keeps only a random-number state for it: nothing is counted).
The tests add the first as a CPU term and run without attention dropout. An fp32 run on a GPU
takes the memory-efficient kernel, whose output is sequence-major whatever q's layout: with
rope its projection input is a view, h/t fewer than counted.

With autocast (--bf16/--fp16) everything is 16-bit, the residual stream too unless
--fp32-residual-connection keeps it fp32. Selective recomputation drops the attention core's
own saves (the log-sum-exp, or the s x s matrices); full recomputation keeps only the input of
each checkpointed span of layers (--recompute-method, --recompute-num-layers; block keeps the
other layers' whole sets), and a span's whole sets while it is replayed
(megart.plan.recompute_memory).
Korthikanti et al.'s 34 s b h (with a 5 a s/h attention term) counts Megatron's tensors, which
differ slightly (dropout masks; Megatron re-gathers sequence-parallel inputs in backward).

Context parallelism (cp ranks, megart.models.context_parallel) gives each rank s/cp tokens of
every sequence: every term above counts those. Attention then all-gathers keys and values
after the q/k/v projection, and each query chunk attends to the keys up to its own end under a
causal bias aligned to the lower right, which flash kernels take without a mask tensor (a CPU
builds each block's boolean mask for the call; not counted here), so each layer also keeps
    the gathered keys and values           2 h/t per token of the whole sequence (with grouped
                                           queries the keys and values repeated per head, which
                                           replace the local ones counted above; with selective
                                           recomputation the gathered 2 kv/t, the checkpoint's
                                           inputs)
and the first stage the int64 global positions of learned position embeddings (s/cp).
Under the ring (--cp-comm-type p2p) and the all-to-all (a2a) no layer keeps another rank's keys
and values: ring_attention_elements, a2a_attention_elements.
"""

from __future__ import annotations

from dataclasses import dataclass

from megart.models.config import GPTConfig
from megart.models.recompute import recomputed_modules
from megart.plan.mla_cp import mla_cp_elements
from megart.plan.mla_memory import mla_attention_bytes, mla_weight_grad_elements
from megart.plan.timing import cp_score_share


@dataclass(frozen=True)
class Precision:
    residual: int  # bytes per element of the residual stream (norm inputs)
    other: int  # bytes per element of the other saved activations


def precision_of(bf16: bool, fp16: bool, fp32_residual_connection: bool = False) -> Precision:
    """megart's saved activations: 16-bit under autocast, the residual stream too unless
    --fp32-residual-connection; fp32 otherwise."""
    if not (bf16 or fp16):
        return Precision(4, 4)
    return Precision(4 if fp32_residual_connection else 2, 2)


def norm_statistics(cfg: GPTConfig) -> int:
    """Bytes per token a norm saves besides its input. LayerNorm: fp32 mean and rstd. megart's
    RMSNorm computes in fp32: the fp32 rsqrt and the normalised product (fp32 with an fp32
    stream; with a 16-bit one the product is 16-bit and the fp32 copy of the input is kept,
    2 h bytes more than the input: the same sum)."""
    return 2 * 4 if cfg.normalization != "rmsnorm" else cfg.hidden_size * 4 + 4


def layer_bytes(
    cfg: GPTConfig,
    b: int,
    tp: int,
    sp: bool,
    recompute: str | None,
    prec: Precision,
    unfused_attention: bool = False,
    cp: int = 1,
) -> float:
    """Bytes one layer keeps for one microbatch until its backward (``cp``: context-parallel
    ranks, each holding s/cp tokens of every sequence)."""
    s, h, t, f = cfg.seq_length, cfg.hidden_size, tp, cfg.ffn_size
    tokens = s // cp * b
    seq_share = 1 / t if sp else 1.0
    if recompute == "full":
        return tokens * h * seq_share * prec.residual
    modules = recomputed_modules(cfg, recompute)
    norms_again, mlp_again = "layernorm" in modules, "mlp" in modules
    # Attention's own terms as with or without the core's recomputation.
    recompute = "selective" if "core_attn" in modules else None
    heads = cfg.num_attention_heads // t
    residual = 2 * h * seq_share * prec.residual
    norm_out = 0.0 if norms_again else sum(norm_outputs(cfg, tp, sp, prec, mlp_again))
    ring = cp > 1 and cfg.cp_comm_type == "p2p"
    a2a = cp > 1 and cfg.cp_comm_type == "a2a"
    if cfg.multi_latent_attention:  # plan.mla_memory: its bytes below, as qk_norms' are
        attention = 0.0
    elif cp == 1:
        attention = attention_elements(cfg, t, recompute, prec.other < 4)
    elif ring:
        attention = ring_attention_elements(cfg, t, recompute, prec.other < 4)
    elif a2a:
        attention = a2a_attention_elements(cfg, t, recompute, prec.other < 4, unfused_attention)
    else:  # context parallelism's count, as it was (its rope and selective terms unaudited)
        # Attention keeps q, k and v per query head: views of the fused output with one group
        # per head; with fewer groups the repeated keys and values, and q, which is a view of
        # the fused output when a rank holds one group and a copy otherwise.
        q = cfg.query_size
        qkv = 3 * q / t
        groups = cfg.query_groups // t
        if groups * t != cfg.num_attention_heads:
            fused = (q + 2 * cfg.query_groups * cfg.head_dim) / t
            qkv = 2 * q / t + (fused if groups == 1 else q / t)
            qkv -= 2 * q / t  # the repeated keys and values span the whole sequence: below
        attention = qkv + q / t
    mlp = 0 if mlp_again else (4 if cfg.activation == "swiglu" else 2) * f / t
    other = (attention + mlp) * prec.other
    norms = 0 if norms_again else 2 * seq_share * norm_statistics(cfg)
    masks = 2 * h * seq_share * dropout_mask_bytes(cfg)
    # With context parallelism only the norms' own saves are added (the count as it was).
    qk_norms = qk_norm_bytes(cfg, t, prec)
    if cfg.multi_latent_attention:  # its projections', latents' and norms' saves
        own, whole = mla_cp_elements(cfg, t, cp, recompute)  # --cp-comm-type's changes
        qk_norms = mla_attention_bytes(cfg, t, sp, recompute, prec) + own * prec.other
    core = 0.0
    if recompute != "selective":  # unfused: the scores of each query against its keys
        # a2a: s x s scores of heads/(t cp) heads, as many per rank as heads/t over s/cp rows.
        keys = s if cp == 1 or a2a else s * cp_score_share(cp)
        # The ring keeps its fp32 log-sum-exp, as flash does, whatever the backend.
        core = heads * 4 if ring or not unfused_attention else 5 * heads * keys * prec.other / 2
    local = tokens * (residual + norm_out + other + norms + masks + qk_norms + core)
    if cfg.multi_latent_attention:
        return local + s * b * whole * prec.other
    gathered = cp > 1 and not ring and not a2a
    return local + (gathered_kv_bytes(cfg, b, tp, recompute, prec, cp) if gathered else 0.0)


def norm_outputs(
    cfg: GPTConfig, tp: int, sp: bool, prec: Precision, mlp_again: bool
) -> tuple[float, float]:
    """Bytes per token each of the two norms' outputs keeps: the column-parallel products'
    saved input (the whole sequence with sequence parallelism, gathered; 16-bit under
    autocast), h; under --recompute-modules mlp the second is the MLP's checkpoint input
    instead, the pre-MLP norm's own output (this rank's s/t tokens with sequence parallelism,
    in the residual stream's dtype). --recompute-modules layernorm frees both."""
    h = cfg.hidden_size
    mlp_input = h * (1 / tp if sp else 1.0) * prec.residual if mlp_again else h * prec.other
    return h * prec.other, mlp_input


def attention_elements(cfg: GPTConfig, t: int, recompute: str | None, half: bool = False) -> float:
    """Elements per token one layer's attention keeps besides its input (the norm output),
    without context parallelism, from what megart's Attention hands on (traced with torch's
    saved-tensor hooks). h = heads x head size (the hidden size unless --kv-channels says
    otherwise: GPTConfig.query_size), kv = query groups x head size, the fused q/k/v
    projection's output is (h + 2 kv)/t per token on each of t ranks, and attention keeps its
    q, k and v (flash attention's inputs, or selective recomputation's checkpoint inputs):

    - q: a view of the fused output, except with rope (rope's output, h/t, a new tensor) or
      with more than one query group per rank (the per-head reshape copies it, h/t).
    - k: a view, except with rope (rope's output: h/t, or kv/t under selective recomputation,
      which keeps k before it is repeated per head); with grouped queries and no selective
      recomputation the keys repeated per head, h/t, whichever k was before.
    - v: a view, or with grouped queries and no selective recomputation repeated per head, h/t.
    - the fused output, (h + 2 kv)/t, whenever one of the three is a view of it.
    - the attention output h/t (the projection's input, a view of it), and with rope a second
      h/t: flash attention's output follows q's memory layout, and rope's q is laid out
      [b, heads, s, d], so the projection's [s, b, h] input is a copy, not a view (with
      selective recomputation only that copy is kept).

    With --qk-layernorm q and k are the norms' outputs, new tensors (before rope, which keeps
    only its own output); the norms' own saves are qk_norm_bytes.

    Multi-head attention with learned positions: 3 h/t + h/t, as Korthikanti et al. count
    q, k, v and the attention output; with rope 7 h/t."""
    h, kv = cfg.query_size, cfg.query_groups * cfg.head_dim
    rope, qk = cfg.position_embedding == "rotary", cfg.qk_layernorm
    grouped = cfg.query_groups != cfg.num_attention_heads
    q_reshaped = grouped and cfg.query_groups // t > 1  # the per-head reshape copies q
    q_copied = rope or qk or q_reshaped  # qk: the norms' outputs are new tensors
    if recompute == "selective":  # the checkpoint's inputs: k and v before the repetition
        kept = (h if q_copied else 0) + (kv if rope or qk else 0)
        views = True  # v always is one
    else:
        k_new, v_new = rope or qk or grouped, grouped
        kept = (h if q_copied else 0) + (h if k_new else 0) + (h if v_new else 0)
        views = not (q_copied and k_new and v_new)
    if qk and qk_norm_keeps_input(cfg, half):
        # The norms keep their inputs: k is a view of the fused output, and q a view of it
        # too, or the reshape's copy (kept by the norm, besides the norm's output).
        kept += h if q_reshaped else 0
        views = True
    fused = h + 2 * kv if views else 0
    # Under selective recomputation flash attention's own output is recomputed, not kept.
    out = h * (2 if rope and recompute != "selective" else 1)
    return (kept + fused + out) / t


def qk_norm_keeps_input(cfg: GPTConfig, half: bool) -> bool:
    """Whether --qk-layernorm's norms keep their inputs: LayerNorm does; megart's RMSNorm
    keeps its fp32 view of the input, which is the input itself only without autocast."""
    return cfg.normalization != "rmsnorm" or not half


def qk_norm_bytes(cfg: GPTConfig, t: int, prec: Precision) -> float:
    """Bytes per token --qk-layernorm's query and key norms keep besides their inputs (see
    attention_elements), over heads/t query and groups/t key heads of head_dim channels each:
    LayerNorm, an fp32 mean and rstd per head (a GPU's; a CPU's 16-bit LayerNorm keeps them
    16-bit); RMSNorm, an fp32 rsqrt per head and the normalised product before the weight
    (the activations' dtype), and under autocast the fp32 copy of the input it normalises."""
    if not cfg.qk_layernorm:
        return 0.0
    heads = (cfg.num_attention_heads + cfg.query_groups) / t
    if cfg.normalization != "rmsnorm":
        return heads * 2 * 4
    channels = heads * cfg.head_dim
    half = prec.other < 4
    return heads * 4 + channels * prec.other + (channels * 4 if half else 0)


def ring_attention_elements(
    cfg: GPTConfig, t: int, recompute: str | None, half: bool = False
) -> float:
    """attention_elements under context parallelism's ring (--cp-comm-type p2p,
    megart.models.ring_attention), per token of the rank's own: it keeps q, k and v as given
    (k and v per group, never repeated: what selective recomputation's checkpoint keeps
    without context parallelism) and its output, a new tensor [b, heads, s/cp, d] that the
    projection's [s, b, h] input copies (h/t each; under selective recomputation only the
    copy), besides its fp32 log-sum-exp (layer_bytes' core term). No other rank's K/V."""
    selective = attention_elements(cfg, t, "selective", half)
    return selective + (0 if recompute == "selective" else cfg.query_size / t)


def a2a_attention_elements(
    cfg: GPTConfig, t: int, recompute: str | None, half: bool = False, unfused: bool = False
) -> float:
    """attention_elements under context parallelism's all-to-all (--cp-comm-type a2a,
    megart.models.all_to_all_attention), per token of the rank's own (traced with torch's
    saved-tensor hooks). Its exchanges save nothing, so nothing before them is kept for
    attention's sake: the kernel's inputs are the exchanged q, k and v, heads/(t cp) heads of
    the whole sequence (with grouped queries the keys and values repeated per head), h/t each
    per own token; flash attention's output, as many; and the projection's input, a copy of
    the returned output (h/t). torch's math kernel (``unfused``) keeps no output (its scores
    are layer_bytes' core term). --qk-layernorm's norms that keep their inputs keep the fused
    q/k/v output, and the per-head reshape's copy of q with more than one group per rank.
    Selective recomputation's checkpoint keeps q, k and v before the exchange, as the ring's
    does (attention_elements' selective count)."""
    if recompute == "selective":
        return attention_elements(cfg, t, "selective", half)
    h, kv = cfg.query_size, cfg.query_groups * cfg.head_dim  # h: all query heads' width
    kept = (4 if unfused else 5) * h
    if cfg.qk_layernorm and qk_norm_keeps_input(cfg, half):
        grouped = cfg.query_groups != cfg.num_attention_heads
        kept += h + 2 * kv + (h if grouped and cfg.query_groups // t > 1 else 0)
    return kept / t


def rope_table_bytes(cfg: GPTConfig, cp: int = 1) -> float:
    """rope's cos and sin, fp32 [s/cp, rotary_dim/2] each, made once per chunk and microbatch
    and held until that pair's backward: saved by every layer's rotation (the same two
    tensors), or under full recomputation kept by the checkpoints to replay (megart.models.gpt
    hands them to each span); none with learned positions."""
    if cfg.position_embedding != "rotary":
        return 0.0
    return cfg.seq_length // cp * cfg.rotary_dim * 4


def gathered_kv_bytes(
    cfg: GPTConfig, b: int, tp: int, recompute: str | None, prec: Precision, cp: int
) -> float:
    """What context parallelism's attention adds to a layer's saves for one microbatch: the
    keys and values all-gathered over the whole sequence (repeated per query head with grouped
    queries; as gathered, 2 kv/t, when selective recomputation's checkpoint keeps them). No
    mask: the causal bias of each query chunk is no tensor on a GPU."""
    s, t = cfg.seq_length, tp
    if recompute == "selective":
        kv = 2 * cfg.query_groups * cfg.head_dim / t
    else:
        kv = 2 * cfg.query_size / t
    return s * b * kv * prec.other


def dropout_mask_bytes(cfg: GPTConfig) -> int:
    """Bytes per element of a hidden-dropout mask: a GPU's fused dropout keeps a bool mask;
    none without dropout (a CPU keeps the mask in the activations' dtype instead)."""
    return 1 if cfg.hidden_dropout > 0 else 0


def first_stage_bytes(cfg: GPTConfig, b: int, tp: int, cp: int = 1, sp: bool = False) -> float:
    """The embedding's saves: token ids (int64) and, with t > 1, the mask of ids held
    elsewhere (one byte); with context parallelism and learned positions, the int64 global
    positions that index the position table; with hidden dropout the embedding dropout's
    mask (this rank's slice of the sequence with sequence parallelism)."""
    local = cfg.seq_length // cp
    rows = local * 8 if cp > 1 and cfg.position_embedding == "learned" else 0
    mask = cfg.hidden_size / (tp if sp else 1) * dropout_mask_bytes(cfg)
    return local * b * (8 + 1 + mask) + rows


def last_stage_bytes(
    cfg: GPTConfig, b: int, tp: int, sp: bool, prec: Precision, cp: int = 1
) -> float:
    """The final norm, output layer and vocab-parallel cross-entropy: norm input and output,
    the loss's saves over this rank's vocabulary slice, and the padding mask of the last
    tensor-parallel rank (the one holding padded entries); this rank's s/cp tokens. The
    unfused loss keeps the fp32 softmax, the int64 local targets and two boolean masks;
    --cross-entropy-loss-fusion keeps the logits themselves (the compute dtype: its backward
    writes their gradient there), the int64 targets, the fp32 maximum and sum, and one mask."""
    s, h = cfg.seq_length, cfg.hidden_size
    tokens = s // cp * b
    vocab = cfg.padded_vocab_size(tp) // tp
    seq_share = 1 / tp if sp else 1.0
    norm = tokens * (seq_share * (h * prec.residual + norm_statistics(cfg)) + h * prec.other)
    padding_mask = vocab if cfg.padded_vocab_size(tp) > cfg.vocab_size else 0
    if cfg.cross_entropy_loss_fusion:
        loss = vocab * prec.other + 8 + 4 + 4 + 1
    else:
        loss = vocab * 4 + 8 + 1 + 1
    return norm + tokens * loss + padding_mask


def output_bytes(cfg: GPTConfig, b: int, tp: int, sp: bool, prec: Precision, cp: int = 1) -> float:
    """A chunk's output, which megart's pipeline engine holds until that chunk's backward."""
    tokens = cfg.seq_length // cp * b
    return tokens * cfg.hidden_size * (1 / tp if sp else 1.0) * prec.residual


def megatron_layer_bytes(
    cfg: GPTConfig, b: int, tp: int, sp: bool, recompute: str | None, unfused_attention: bool
) -> float:
    """Korthikanti et al.'s count for Megatron-LM (16-bit activations, 1-byte dropout masks):
    s b h (10 + 24/t) (34/t with sequence parallelism) plus 5 a s^2 b / t for the kept
    attention scores (none with flash attention or selective recomputation); 2 s b h (/t with
    sequence parallelism) with full recomputation."""
    s, h, t, a = cfg.seq_length, cfg.hidden_size, tp, cfg.num_attention_heads
    tokens = s * b
    if recompute == "full":
        return 2 * tokens * h / (t if sp else 1)
    dense = 34 / t if sp else 10 + 24 / t
    scores = 5 * a * s / (h * t) if unfused_attention and recompute != "selective" else 0.0
    return tokens * h * (dense + scores)


def weight_grad_bytes(cfg: GPTConfig, b: int, tp: int, prec: Precision, cp: int = 1) -> float:
    """Bytes one layer keeps for one microbatch between a zero-bubble schedule's I and W: each
    deferred linear layer's input X and output gradient dY (megart.tensor_parallel.weight_grad),
    16-bit under autocast. Per token: q/k/v's X is the norm output (h; gathered over the whole
    sequence with sequence parallelism) and dY its (h + 2 kv)/t outputs; the projection's X the
    attention output h/t and dY h (a row-parallel output is whole before its reduction); the
    first MLP product's X the norm output h and dY f/t (2 f/t with SwiGLU); the second's X the
    activation f/t and dY h. Held with recomputation too: I recomputes the layer and keeps them.
    With context parallelism each rank holds its s/cp tokens' (the gathered keys and values
    are attention's, not a linear layer's). Multi-latent attention's projections in place of
    q/k/v's and the projection's: plan.mla_memory.mla_weight_grad_elements."""
    h, t, f, q = cfg.hidden_size, tp, cfg.ffn_size, cfg.query_size
    kv = cfg.query_groups * cfg.head_dim
    fc1_out = (2 if cfg.activation == "swiglu" else 1) * f
    attention = h + q / t + (q + 2 * kv) / t + h  # q/k/v's and the projection's X and dY
    if cfg.multi_latent_attention:  # its projections' (plan.mla_memory)
        attention = mla_weight_grad_elements(cfg, t)
    mlp = h + f / t + fc1_out / t + h
    return cfg.seq_length // cp * b * (attention + mlp) * prec.other


def output_weight_grad_bytes(
    cfg: GPTConfig, b: int, tp: int, prec: Precision, cp: int = 1
) -> float:
    """An untied output layer's X (the final norm's output, h) and dY (this rank's logits,
    V_padded/t), kept from the last stage's I to its W; none when tied (the embedding's
    gradient is computed in I)."""
    if not cfg.untie_embeddings_and_output_weights:
        return 0.0
    vocab = cfg.padded_vocab_size(tp) // tp
    return cfg.seq_length // cp * b * (cfg.hidden_size + vocab) * prec.other
