"""Multi-token prediction's depths (--mtp-num-layers D, megart.models.mtp) in megart plan's
memory count: what the last stage's pair keeps for them, beside its layers and loss.

Per depth and token (this rank's slice of the sequence, 1/t, under sequence parallelism where
said), from models.mtp's forward:

    the embedding's lookup of the shifted tokens    its int64 ids (and at t > 1 the mask of ids
                                                    held elsewhere), with learned positions the
                                                    int64 positions; the dropout's mask
    enorm and hnorm                                 each its input (the residual stream) and
                                                    statistics, slice
    eh_proj's input, both norms' outputs joined     2 h (gathered whole under sequence
                                                    parallelism)
    eh_proj's gathered output, under sequence       h (1 - 1/t): the layer's first norm keeps
    parallelism                                     its slice, a view of the whole
    one transformer layer                           activations.layer_bytes (its recomputation),
                                                    an MoE layer's beyond it where the last
                                                    decoder layer is one (moe_memory's
                                                    moe_layer_extra, on the rank's experts)
    the final norm                                  its input and statistics, slice
    the output layer and loss over its tokens       the output layer's input h (the depths'
                                                    outputs joined after the main model's) and
                                                    the loss's saves (activations.last_stage_bytes'
                                                    per token, over this rank's vocabulary)

Under full uniform recomputation each depth is checkpointed whole (models.mtp): it keeps its two
inputs (the hidden states and the embedded tokens) and, while its backward replays it, its whole
saves. Under selective recomputation a depth's MoE layer replays as the decoder's
(moe_memory.moe_replay_bytes; a dense one's MLP as recompute_memory.mlp_replay_bytes).
The depths run once per (microbatch, last chunk) pair, as the loss does, and are counted
so (once, beside the loss: megart.plan.memory).
"""

from __future__ import annotations

from megart.models.config import GPTConfig
from megart.plan.activations import (
    Precision,
    dropout_mask_bytes,
    last_stage_bytes,
    layer_bytes,
    norm_statistics,
    output_weight_grad_bytes,
    weight_grad_bytes,
)
from megart.plan.moe_memory import MoeRank, moe_layer_extra, moe_replay_bytes
from megart.plan.recompute_memory import mlp_replay_bytes


def _depth_bytes(
    cfg: GPTConfig, b: int, tp: int, sp: bool, prec: Precision, cp: int = 1
) -> tuple[float, float]:
    """One depth's saves but its layer's, for one microbatch of this rank's s/``cp`` tokens
    (see the module's doc): (those made outside its checkpoint, the lookup's and the output
    layer's and loss's; those inside)."""
    s, h, t = cfg.seq_length // cp, cfg.hidden_size, tp
    own = 1 / t if sp else 1.0
    lookup = 8 + (1 if t > 1 else 0) + (8 if cfg.position_embedding == "learned" else 0)
    lookup += h * own * dropout_mask_bytes(cfg)
    norm = own * (h * prec.residual + norm_statistics(cfg))  # an input and its statistics
    joined = 2 * h * prec.other
    if sp and t > 1:  # the layer's first norm keeps its slice of eh_proj's gathered output,
        joined += h * (1 - own) * prec.other  # a view of the whole: the other ranks' rows too
    # The output layer's input for the depth's tokens, and the loss's saves on them: the last
    # stage's bytes less its final norm's.
    loss = last_stage_bytes(cfg, b, t, sp, prec, cp) / (s * b) - norm
    return s * b * (lookup + loss), s * b * (3 * norm + joined)


def mtp_loss_bytes(
    cfg: GPTConfig, b: int, tp: int, sp: bool, prec: Precision, cp: int = 1
) -> float:
    """Of mtp_stage_bytes' kept bytes, those made outside the depths' checkpoints: their
    lookups', and their output layer's and loss's, which the loss's backward frees before any
    depth is replayed."""
    return (cfg.mtp_num_layers or 0) * _depth_bytes(cfg, b, tp, sp, prec, cp)[0]


def mtp_stage_bytes(
    cfg: GPTConfig, b: int, tp: int, sp: bool, prec: Precision, rank: MoeRank | None = None
) -> tuple[float, float]:
    """The depths' saves on the last stage for one microbatch, and how far above them a
    depth's replay rises (full uniform recomputation's whole depth, selective's MoE layer or
    MLP; 0 otherwise): (kept, rise). ``rank``: where a depth's MoE layer runs (its weights'
    bytes, expert parallelism and the token copies its experts get; None: ``prec``, ``tp``
    and ``sp``, one expert-parallel rank, balanced; its ``cp``: context parallelism's ranks,
    the depths' tokens this rank's s/cp)."""
    depths = cfg.mtp_num_layers or 0
    if not depths:
        return 0.0, 0.0
    rank = rank or MoeRank(prec, 1, 4, tp, sp)
    moe = cfg.is_moe_layer(cfg.num_layers)  # the depths' layers are the last decoder layer's kind
    rec = cfg.recompute_granularity
    cp = rank.cp
    outside, inside = _depth_bytes(cfg, b, tp, sp, prec, cp)
    if rec == "full" and cfg.recompute_method == "uniform":
        whole = inside + layer_bytes(cfg, b, tp, sp, None, prec, cp=cp)
        whole += moe_layer_extra(cfg, b, None, rank) if moe else 0.0
        inputs = 2 * cfg.seq_length // cp * b * cfg.hidden_size * (1 / tp if sp else 1.0)
        inputs *= prec.residual
        return depths * (outside + inputs), whole - inputs
    # Under block the depths are not recomputed (models.mtp): whole, as without it.
    layer_rec = None if rec == "full" else rec
    layer = layer_bytes(cfg, b, tp, sp, layer_rec, prec, cp=cp)
    layer += moe_layer_extra(cfg, b, layer_rec, rank) if moe else 0.0
    rise = 0.0
    if rec == "selective":
        rise = moe_replay_bytes(cfg, b, rank) if moe else mlp_replay_bytes(cfg, b, tp, sp, prec, cp)
    return depths * (outside + inside + layer), rise


def mtp_weight_grad_bytes(cfg: GPTConfig, b: int, tp: int, prec: Precision, cp: int = 1) -> float:
    """What the depths keep for one microbatch on the last stage between a zero-bubble
    schedule's I and W, beside the output layer's own tokens (activations.
    output_weight_grad_bytes): each depth's layer's deferred projections (weight_grad_bytes),
    eh_proj's input (2h, gathered whole under sequence parallelism) and output gradient (h/t),
    and an untied output layer's input and logits' gradient over the depth's tokens."""
    depths = cfg.mtp_num_layers or 0
    h = cfg.hidden_size
    proj = cfg.seq_length // cp * b * (2 * h + h / tp) * prec.other  # this rank's s/cp tokens
    each = weight_grad_bytes(cfg, b, tp, prec, cp) + proj
    each += output_weight_grad_bytes(cfg, b, tp, prec, cp)
    return depths * each
