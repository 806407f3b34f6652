"""What a (microbatch, chunk) pair's layers hold under full recomputation, spans as megart
train runs them (--recompute-method, --recompute-num-layers; megart.models.recompute), from one
layer's saves (megart.plan.activations): the bytes kept until the pair's backward, and how far
above them the backward rises while a span is replayed."""

from __future__ import annotations

from collections.abc import Sequence

from megart.models.config import GPTConfig
from megart.models.recompute import recomputed_modules, recomputed_spans
from megart.plan.activations import Precision, layer_bytes, norm_outputs, norm_statistics
from megart.plan.moe_memory import (
    MoeRank,
    checkpointed_mlp_bytes,
    moe_layer_extra,
    moe_replay_bytes,
)


def chunk_layer_bytes(
    cfg: GPTConfig,
    b: int,
    tp: int,
    sp: bool,
    prec: Precision,
    layers: int,
    unfused_attention: bool = False,
    cp: int = 1,
    extras: Sequence[float] = (),
    moe: Sequence[bool] = (),
    weight_bytes: int = 4,
    ep: int = 1,
    expert_tokens: float = 1.0,
) -> tuple[float, float]:
    """A (microbatch, chunk) pair's ``layers`` layers: (the bytes they keep until its backward,
    how far above that its backward rises while full recomputation replays a span; see
    full_recompute_bytes). Rope's tables are not counted here (rope_table_bytes: once a
    pair); under --recompute-modules mlp the rise is one MLP's replay (mlp_replay_bytes),
    under moe or shared_experts an MoE layer's (moe_memory.moe_replay_bytes): the larger.
    ``extras``: what each layer's saves without recomputation add to layer_bytes' (a
    tiled sliding window's second attention output, plan.window_memory), none where selective
    recomputation recomputes the attention core (--recompute-modules core_attn: recomputed
    with it) and under full recomputation while replayed (or kept, by block's kept layers).
    ``moe``: whether each layer is a mixture-of-experts layer (plan.moe_memory: its saves
    beyond a dense layer's; none: all dense), with weights of ``weight_bytes``, its experts
    spread over ``ep`` ranks, this one's getting ``expert_tokens`` k T token copies."""
    rec = cfg.recompute_granularity
    one = layer_bytes(cfg, b, tp, sp, rec, prec, unfused_attention, cp)
    extras = list(extras) or [0.0] * layers
    moe = list(moe) or [False] * layers
    rank = MoeRank(prec, cp, weight_bytes, tp, sp, ep, expert_tokens)
    if rec != "full":
        core_again = "core_attn" in recomputed_modules(cfg, rec)
        # Only dense MLPs are checkpointed by --recompute-modules mlp (models.blocks); MoE
        # layers by moe, their shared experts by shared_experts (plan.moe_memory).
        replay = mlp_replay_bytes(cfg, b, tp, sp, prec, cp) if not all(moe) else 0.0
        if any(moe):
            replay = max(replay, moe_replay_bytes(cfg, b, rank))
        moe_extra = moe_layer_extra(cfg, b, rec, rank)
        kept = layers * one + sum(moe) * moe_extra
        return kept + (0.0 if core_again else sum(extras)), replay
    whole = layer_bytes(cfg, b, tp, sp, None, prec, unfused_attention, cp)
    moe_whole = moe_layer_extra(cfg, b, None, rank)
    extras = [x + (moe_whole if m else 0.0) for x, m in zip(extras, moe, strict=True)]
    method, n = cfg.recompute_method, cfg.recompute_num_layers
    # The first norm keeps the span's input itself (LayerNorm; RMSNorm's fp32 view of it when
    # the stream is fp32), else its fp32 copy: counted in ``whole`` either way.
    shared = cfg.normalization != "rmsnorm" or prec.residual == 4
    wholes = [whole + extra for extra in extras]
    return full_recompute_bytes(layers, method, n, one, wholes, shared)


def full_recompute_bytes(
    layers: int,
    method: str,
    num_layers: int,
    input_bytes: float,
    whole: float | Sequence[float],
    shared: bool = True,
) -> tuple[float, float]:
    """One (microbatch, chunk) pair of ``layers`` layers under full recomputation, spans as
    megart train runs them (models.recompute.recomputed_spans: --recompute-method uniform,
    groups of --recompute-num-layers layers; block, the first N layers one by one and the rest
    kept): (the bytes it keeps from its forward to its backward, how far above that its
    backward rises while a span is recomputed). ``input_bytes``: one layer's input (what a
    checkpoint keeps), ``whole``: one layer's saves without recomputation (or each layer's),
    ``shared``: the replayed first layer saves the span's kept input itself (not a copy of
    it). Rope's tables are the pair's whatever the spans (rope_table_bytes).

    Kept: each checkpointed span's input and the kept layers' whole saves. Backward runs the
    spans last first, each freeing its saves; a checkpointed span's recomputation makes all its
    layers' saves at once (torch's checkpoint recomputes the span at the first saved tensor
    backward asks for, and frees each one as it is used), its first layer's input being the
    span's kept input (``shared``). So recomputing span k holds the inputs of spans 0..k and
    span k's layers' whole saves (but the shared input): with equal groups the last span's
    moment is the highest, with a shorter last group (N not dividing the layers) the one before
    may be. Under block with N < layers the kept layers held as much at the start of the
    backward: nothing rises."""
    wholes = [whole] * layers if isinstance(whole, (int, float)) else list(whole)
    held = peak = kept = 0.0
    for start, stop, recomputed in recomputed_spans(layers, method, num_layers):
        if recomputed:
            held += input_bytes
            again = sum(wholes[start:stop]) - (input_bytes if shared else 0.0)
            peak = max(peak, held + again)
        else:
            kept += sum(wholes[start:stop])
    stored = held + kept
    return stored, max(0.0, peak - stored)


def dropped_norms_rise(
    cfg: GPTConfig, b: int, tp: int, sp: bool, prec: Precision, cp: int = 1
) -> float:
    """How far above its layers' kept bytes a rank's saves rise under --recompute-modules
    layernorm (models.dropped_output), at one layer of the pair in flight: in its forward a
    norm's output stays saved until the products that read it have run (the pre-MLP norm's
    until the MLP's saves are made, the input norm's before the MLP), and when the backward
    reaches the pair's last layer it makes the pre-MLP norm's output again with the norm's
    own saves (LayerNorm's mean and rstd, RMSNorm's fp32 product or fp32 input copy: a 16-bit
    stream's RMSNorm also keeps its 16-bit product) before the MLP's backward frees anything.
    The rank's peak on a last stage already holds the loss's saves, freed by that backward
    (megart.plan.memory takes the larger)."""
    if not cfg.recomputes("layernorm"):
        return 0.0
    attention_input, mlp_input = norm_outputs(cfg, tp, sp, prec, cfg.recomputes("mlp"))
    again = norm_statistics(cfg)
    if cfg.normalization == "rmsnorm" and prec.residual < 4:
        again += cfg.hidden_size * prec.residual
    tokens = cfg.seq_length // cp * b
    return tokens * max(attention_input, mlp_input + again * (1 / tp if sp else 1.0))


def mlp_replay_bytes(
    cfg: GPTConfig, b: int, tp: int, sp: bool, prec: Precision, cp: int = 1
) -> float:
    """--recompute-modules mlp: what one dense MLP's replay in the backward holds at once above
    the layers' kept bytes (torch's checkpoint makes all its saves before the MLP's backward
    frees any; moe_memory.checkpointed_mlp_bytes)."""
    if not cfg.recomputes("mlp"):
        return 0.0
    return checkpointed_mlp_bytes(cfg, b, tp, sp, prec, cp, cfg.ffn_size)
