"""What a mixture-of-experts layer (megart.models.moe) saves for its backward, beyond what
activations.layer_bytes counts for a dense layer of the same model: the router's saves and
those of the experts in place of the dense MLP's. Traced with torch's saved-tensor hooks on
real megart train ranks (tests/test_plan_memory_moe.py).

Per token of a microbatch (T of them), k = --moe-router-topk, E = --num-experts, f the
experts' width (--moe-ffn-hidden-size), r the router's bytes per element (--moe-router-dtype,
else the activations'), w = max(r, 4) (softmaxes over experts run in fp32 at least):

    the router's input            h in r, when --moe-router-dtype casts it (else the norm's
                                  output, which layer_bytes counts already); and once per
                                  microbatch its weight cast to r, E h, where r is not the
                                  weights' dtype
    routing                       top-k of the logits then softmax: the softmax's k weights
                                  (w) and the top-k indices (int64, k); pre-softmax: the
                                  softmax over all E (w) and the indices; sigmoid: the fp32
                                  scores (E) and the indices, with k > 1 the chosen scores and
                                  their sum (k + 1, r)
    load-balancing loss (coeff>0) its softmax over the E logits (w; sigmoid scores: the
                                  scores and their sum, E + 1 in r), and once per microbatch
                                  the experts' token counts (E) and the loss (1), w (r);
                                  seq_aux_loss counts E per sequence (b E), global_aux_loss
                                  keeps the running counts' mean (E, the weights' dtype)
                                  and the loss in the wider of it and the scores'
    group-limited routing         the groups' mask (E, bool), unless the expert bias picks
                                  (the biased top k's values are dropped, and with them the
                                  mask; the weights are gathered by the indices)
    expert bias                   nothing more: the chosen scores gathered by the same k
                                  indices the top k would save (its token counts, E fp32,
                                  wait in an autograd function's context, which torch's
                                  hooks do not see: left out)
    z-loss (coeff given)          the logits (E, r) and their log-sum-exp (r), and once the
                                  loss (r)
    each of its k experts         its gathered input and its output (h each: the sum's
                                  index_add keeps its source), the MLP's tensors (GeLU and squared
                                  ReLU 3 f: the dense MLP's two and the activation scaled by
                                  the routing weight, which the last product saves; SwiGLU
                                  5 f, the dense four and the scaled one), the token's routing
                                  weight (r) and its row index (int64)

in place of the dense MLP's 2 f or 4 f.

Under tensor parallelism (t ranks, sequence parallelism required: models.moe) the router runs
on this rank's s/t slice of the sequence: its input and every routing and loss term above are
per token of the slice (the once-per-microbatch terms as they are: the token counts, summed
over the ranks, are still E), in place of the gathered norm output layer_bytes counts for a
dense MLP's input (h per token of the whole sequence). The experts run on the tokens gathered
from every rank, each rank f/t of every expert's width: their terms are per token of the whole
sequence, with f/t for f (and the dense MLP's 2 f/t or 4 f/t are what they replace). The
gathers and the reduce-scatter save nothing. Exact on real tp2 ranks as at t = 1.

Every expert term is per token an expert got, and the experts' counts add up to k T whatever
the routing, so the bytes do not depend on which expert got which token: exact, not an estimate
of the routing (measured with the experts' actual counts by the same hooks). What may differ on
a GPU: nothing that is kernel-specific here (no fused kernel runs in an MoE layer).

Under expert parallelism (ep ranks: models.expert_exchange) a rank's tokens are routed as
above, and their k T copies sent to their experts' owners, run there, and sent back
to be summed: per copy the rank sends, the returned output the sum keeps (h) and two row
indices (int64: each expert's rows, and the order the copies leave in); per copy its own
experts get, from any rank, the expert's input and output (h each: the output kept by the
copy into the returned buffer), its MLP's tensors, its routing weight (r) and two row indices
(int64: its rows, and where its outputs go). The exchanges themselves save nothing. How many
copies a rank's experts get is the routing's: k T on every rank when it is balanced (what the
planner assumes; the group's ranks send ep k T copies in all), from 0 to ep k T otherwise;
``expert_tokens`` gives it in k T. Beside tensor parallelism (sequence parallelism) the
copies are of the tokens gathered over the t ranks (T the whole sequence's: each tensor-
parallel rank exchanges them all with the ranks of its own tensor-parallel rank), the experts
f/t wide; under context parallelism T is the rank's s/cp. Exact on real ep2, ep2 x tp2, ep2 x
cp2 and ep2 x tp2 x cp2 ranks with the routing prescribed (tests/test_plan_moe_ep.py,
tests/test_plan_moe_ep_tp.py), and MoE layers under cp2 and cp2 x tp2 without it.

Shared experts (--moe-shared-expert-intermediate-size S: a dense MLP of width S over the
layer's input, tensor-parallel as the dense MLP, whole on every expert-parallel rank) save what
a dense MLP of width S saves: 2 S/t or 4 S/t per token of the whole sequence, and their first
product's input, h, unless that is the layer's input itself and the router keeps it already
(no gather at t = 1, no autocast copy, the router in the stream's dtype). Their gate
(--moe-shared-expert-gate: sigmoid(x . w), w [1, h], scaling their output) saves per token of
this rank's slice the shared output and the sigmoid's (h + 1, which the gating product keeps)
and its product's input, the layer's input (h: autocast's copy, else the input itself unless
the router or the shared experts' product keeps it already); exact on real tp1, tp2 and ep2
ranks (tests/test_plan_moe_gate.py).

Recomputation: full recomputation keeps an MoE layer's input like any layer's and replays all
of the above. --recompute-modules mlp checkpoints dense MLPs only (models.blocks, as
Megatron-Core's "mlp"): an MoE layer keeps its whole saves, and its norm output is the router's
input rather than a checkpoint's. --recompute-modules moe checkpoints the whole MoE layer from
its input, which it alone keeps (this rank's slice, the stream's dtype: what mlp keeps of a
dense layer); the backward rises, while it replays, by all its saves but that input.
(torch's saved-tensor hooks also see the load-balancing loss's top-k indices made again, k
int64 per token of the slice, which the replay frees at once as the first forward did: nothing
reads that top-k's values. tests/plan_workers.py's count keeps them where the allocator gives
their storage to no later save.) --recompute-modules
shared_experts checkpoints the shared experts' MLP from the layer's input: the layer keeps all
but its tensors and its product's input copy (and keeps that input itself where the router
keeps a cast of it), and the replay rises by a checkpointed MLP's (checkpointed_mlp_bytes)
and their gate's saves.
Both named: moe's replay stops at the shared experts' checkpoint (their input is its last
save), whose own replay follows at once, both held: the rise is moe's. Exact on real tp1, tp2
and ep2 ranks (tests/test_plan_moe_shared.py). --recompute-modules layernorm with MoE layers
is refused (plan.flags: megart train cannot run it yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from megart.models.config import GPTConfig
from megart.models.recompute import recomputed_modules
from megart.plan.activations import Precision, norm_outputs
from megart.plan.moe_time import ROUTER_BYTES


@dataclass(frozen=True)
class MoeRank:
    """Where an MoE layer's microbatch runs, as its saves depend on it: activations of
    ``prec``, this rank's 1/``cp`` of the sequence, weights of ``weight_bytes`` (2 under
    --half-weights, which --moe-router-dtype's cast of the router's weight copies when they
    differ), one of ``tp`` tensor-parallel ranks (with sequence parallelism, ``sp``, which
    megart train requires for experts at tp > 1), and of ``ep`` expert-parallel ranks, this
    one's experts getting ``expert_tokens`` k T token copies (1: balanced routing; the
    module's doc)."""

    prec: Precision
    cp: int = 1
    weight_bytes: int = 4
    tp: int = 1
    sp: bool = False
    ep: int = 1
    expert_tokens: float = 1.0


def moe_layer_extra(cfg: GPTConfig, b: int, recompute: str | None, rank: MoeRank) -> float:
    """Bytes an MoE layer keeps for one microbatch of ``b`` sequences on ``rank`` beyond
    activations.layer_bytes' count of a dense layer under ``recompute`` (none under full
    recomputation: the layer's input alone, as a dense layer's)."""
    if recompute == "full":
        return 0.0
    modules = recomputed_modules(cfg, recompute)
    tp, sp, prec = rank.tp, rank.sp, rank.prec
    tokens = cfg.seq_length // rank.cp * b
    # What layer_bytes counted for a dense MLP: its input (the gathered norm output, or
    # --recompute-modules mlp's checkpoint input) and, unless mlp, its tensors.
    counted = norm_outputs(cfg, tp, sp, prec, "mlp" in modules)[1]
    if "mlp" not in modules:
        counted += (4 if cfg.activation == "swiglu" else 2) * cfg.ffn_size / tp * prec.other
    if "moe" in modules:  # the checkpoint keeps the layer's input alone (this rank's slice)
        return tokens * (norm_outputs(cfg, tp, sp, prec, True)[1] - counted)
    shared = "shared_experts" not in modules
    saves = moe_saves(cfg, b, rank, shared)
    checkpoint = not shared and cfg.moe_shared_expert_intermediate_size
    if checkpoint and not _router_keeps_input(cfg, prec):  # the checkpoint's input, kept
        saves += tokens * norm_outputs(cfg, tp, sp, prec, True)[1]
    return saves - tokens * counted


def moe_replay_bytes(cfg: GPTConfig, b: int, rank: MoeRank) -> float:
    """Under selective recomputation, how far above the layers' kept bytes an MoE layer's
    backward rises while torch's checkpoint replays it (all of the replay's saves made before
    its backward frees any): --recompute-modules moe, the whole layer's saves (moe_saves) but
    its input, which the checkpoint kept; shared_experts alone, the shared experts' MLP's
    (checkpointed_mlp_bytes); 0 when neither is recomputed."""
    tp, sp, prec, cp = rank.tp, rank.sp, rank.prec, rank.cp
    if cfg.recomputes("moe"):
        saves = moe_saves(cfg, b, rank)
        return saves - cfg.seq_length // cp * b * _input_itself(cfg, tp, sp, prec)
    width = cfg.moe_shared_expert_intermediate_size
    if cfg.recomputes("shared_experts") and width:  # the gate replayed with them
        gate = cfg.seq_length // cp * b * gate_bytes(cfg, tp, sp, prec, counted=True)
        return checkpointed_mlp_bytes(cfg, b, tp, sp, prec, cp, width) + gate
    return 0.0


def moe_saves(cfg: GPTConfig, b: int, rank: MoeRank, shared: bool = True) -> float:
    """Every byte an MoE layer's MLP part (router, losses, experts, and with ``shared`` the
    shared experts) saves for one microbatch on ``rank`` without recomputation, its input's
    storage included where a save is the input itself (the module's doc)."""
    tp, sp, prec = rank.tp, rank.sp, rank.prec
    h, k, e, fm = cfg.hidden_size, cfg.moe_router_topk, cfg.num_experts, cfg.moe_ffn_size
    other = prec.other
    given = ROUTER_BYTES.get(cfg.moe_router_dtype or "")
    r = given or other
    w = max(r, 4)
    per_token = 0.0  # the router's, per token of this rank's slice of the sequence
    sigmoid = cfg.moe_router_score_function == "sigmoid"
    if sigmoid:
        per_token += e * 4 + 8 * k + ((k + 1) * r if k > 1 else 0)
    elif cfg.moe_router_pre_softmax:
        per_token += e * w + 8 * k
    else:
        per_token += k * (w + 8)
    if cfg.moe_router_group_topk and not (sigmoid and cfg.moe_router_enable_expert_bias):
        per_token += e  # the groups' mask (bool), kept where the top k's values are the weights
    weight_bytes = rank.weight_bytes
    once = e * h * given if given and given != weight_bytes else 0.0
    if cfg.moe_aux_loss_coeff > 0 and sigmoid:
        per_token += (e + 1) * r  # its scores (sigmoid) and their sums, which normalise them
        once += balance_once(cfg, b, r, weight_bytes)
    elif cfg.moe_aux_loss_coeff > 0:
        per_token += e * w
        once += balance_once(cfg, b, w, weight_bytes)
    if cfg.moe_z_loss_coeff:
        per_token += (e + 1) * r
        once += r
    # The router's input, its own copy in --moe-router-dtype or the norm's output (autocast's
    # 16-bit copy of an fp32 one).
    per_token += h * r
    per_token *= 1 / tp if sp else 1.0
    swiglu = cfg.activation == "swiglu"
    # Per token an expert got, over the gathered sequence on every rank: its input, its
    # output (the sum's index_add keeps its source, whose shape it needs), its MLP's tensors
    # over this rank's f/t, its routing weight and row index.
    expert = (5 if swiglu else 3) * fm / tp * other + r
    if rank.ep == 1:
        per_token += k * (2 * h * other + expert + 8)
    else:  # sent: the returned output and two indices; received: the expert's saves
        per_token += k * (h * other + 16) + rank.expert_tokens * k * (2 * h * other + expert + 16)
    width = cfg.moe_shared_expert_intermediate_size
    if shared and width:  # a dense MLP's tensors at S/t, and its input unless the router's
        per_token += (4 if swiglu else 2) * width / tp * other
        itself = _router_keeps_input(cfg, prec) and not _copied(tp, sp, prec)
        per_token += 0.0 if itself else h * other
        counted = _router_keeps_input(cfg, prec) or not _copied(tp, sp, prec)
        per_token += gate_bytes(cfg, tp, sp, prec, counted)
    return cfg.seq_length // rank.cp * b * per_token + once


def balance_once(cfg: GPTConfig, b: int, scores: int, weight_bytes: int) -> float:
    """Bytes the load-balancing loss saves once per microbatch of ``b`` sequences, its scores
    ``scores`` bytes an element: the experts' token counts the scores' product keeps and the
    loss. aux_loss: E counts (the scores' dtype) and the loss; seq_aux_loss: E for each
    sequence; global_aux_loss: the running counts' mean over the iteration's microbatches (E,
    the router's buffer: the weights' dtype) and the loss, in the wider of the two."""
    e, kind = cfg.num_experts, cfg.moe_router_load_balancing_type
    if kind == "seq_aux_loss":
        return (b * e + 1) * scores
    if kind == "global_aux_loss":
        return e * weight_bytes + max(scores, weight_bytes)
    return (e + 1) * scores


def gate_bytes(cfg: GPTConfig, tp: int, sp: bool, prec: Precision, counted: bool) -> float:
    """Bytes per token of the whole sequence that --moe-shared-expert-gate's gate saves (0
    without it), over this rank's slice (sequence parallelism at t > 1): its product's input,
    the layer's input (autocast's 16-bit copy of an fp32 stream; else the input itself, unless
    ``counted``: another save of it is counted already), its sigmoid's output (1, which the
    gating product saves too) and the shared experts' output the gating product saves (h)."""
    if not (cfg.moe_shared_expert_gate and cfg.moe_shared_expert_intermediate_size):
        return 0.0
    h = cfg.hidden_size
    if prec.residual != prec.other:
        entry = h * prec.other
    else:
        entry = 0.0 if counted else h * prec.residual
    return ((h + 1) * prec.other + entry) / (tp if sp else 1)


def checkpointed_mlp_bytes(
    cfg: GPTConfig, b: int, tp: int, sp: bool, prec: Precision, cp: int, width: int
) -> float:
    """What one checkpointed MLP of ``width`` (a dense layer's under --recompute-modules mlp,
    the shared experts' under shared_experts) holds at once while torch's checkpoint replays
    it, above what is kept: its 2 f/t (GeLU, squared ReLU) or 4 f/t (SwiGLU) tensors, and the
    products' saved input where the column-parallel entry makes a new one (the sequence
    gathered over t ranks, or autocast's 16-bit copy of an fp32 stream's norm output), h;
    else that input is the checkpoint's own, kept already."""
    mlp = (4 if cfg.activation == "swiglu" else 2) * width / tp * prec.other
    entry = cfg.hidden_size * prec.other if _copied(tp, sp, prec) else 0.0
    return cfg.seq_length // cp * b * (mlp + entry)


def _copied(tp: int, sp: bool, prec: Precision) -> bool:
    """Whether an MLP's column-parallel entry saves a new tensor rather than its input: the
    sequence gathered over t ranks, or autocast's 16-bit copy of an fp32 stream."""
    return (sp and tp > 1) or prec.residual != prec.other


def _router_keeps_input(cfg: GPTConfig, prec: Precision) -> bool:
    """Whether the router's saved input is the layer's input itself (the pre-MLP norm's
    output, in the stream's dtype): no cast to --moe-router-dtype or autocast's type."""
    return (ROUTER_BYTES.get(cfg.moe_router_dtype or "") or prec.other) == prec.residual


def _input_itself(cfg: GPTConfig, tp: int, sp: bool, prec: Precision) -> float:
    """Bytes per token of moe_saves that are the layer's input's own storage (this rank's
    slice): the router's saved input where it is not a cast, else the shared experts' first
    product's where it is neither cast nor gathered; 0 where every save is a copy."""
    h = cfg.hidden_size
    if _router_keeps_input(cfg, prec):
        return h * prec.residual * (1 / tp if sp else 1.0)
    if cfg.moe_shared_expert_intermediate_size and not _copied(tp, sp, prec):
        return h * prec.other
    if gate_bytes(cfg, tp, sp, prec, counted=False) and prec.residual == prec.other:
        return h * prec.residual * (1 / tp if sp else 1.0)  # the gate's product's input
    return 0.0
