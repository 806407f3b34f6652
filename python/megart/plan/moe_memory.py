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
                                  the experts' token counts (E) and the loss (1), w (r)
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

Under expert parallelism (ep ranks, at t = 1: models.expert_exchange) a rank's tokens are
routed as above, and their k T copies sent to their experts' owners, run there, and sent back
to be summed: per copy the rank sends, the returned output the sum keeps (h) and two row
indices (int64: each expert's rows, and the order the copies leave in); per copy its own
experts get, from any rank, the expert's input and output (h each: the output kept by the
copy into the returned buffer), its MLP's tensors, its routing weight (r) and two row indices
(int64: its rows, and where its outputs go). The exchanges themselves save nothing. How many
copies a rank's experts get is the routing's: k T on every rank when it is balanced (what the
planner assumes; the group's ranks send ep k T copies in all), from 0 to ep k T otherwise;
``expert_tokens`` gives it in k T. Exact on real ep2 ranks with the routing prescribed
(tests/test_plan_moe_ep.py).

Recomputation: full recomputation keeps an MoE layer's input like any layer's and replays all
of the above. --recompute-modules mlp checkpoints dense MLPs only (models.blocks, as
Megatron-Core's "mlp"): an MoE layer keeps its whole saves, and its norm output is the router's
input rather than a checkpoint's. --recompute-modules layernorm with MoE layers is refused
(plan.flags: megart train cannot run it yet).
"""

from __future__ import annotations

from megart.models.config import GPTConfig
from megart.models.recompute import recomputed_modules
from megart.plan.activations import Precision, norm_outputs
from megart.plan.moe_time import ROUTER_BYTES


def moe_layer_extra(
    cfg: GPTConfig,
    b: int,
    recompute: str | None,
    prec: Precision,
    cp: int = 1,
    weight_bytes: int = 4,
    tp: int = 1,
    sp: bool = False,
    ep: int = 1,
    expert_tokens: float = 1.0,
) -> float:
    """Bytes an MoE layer keeps for one microbatch beyond activations.layer_bytes' count of a
    dense layer under ``recompute`` (none under full recomputation: the layer's input alone,
    as a dense layer's), on one of ``tp`` tensor-parallel ranks (with sequence parallelism,
    ``sp``, which megart train requires for experts at tp > 1). ``weight_bytes``: the weights'
    (2 under --half-weights), which --moe-router-dtype's cast of the router's weight copies
    when they differ. ``ep``: expert-parallel ranks (at t = 1), this one's experts getting
    ``expert_tokens`` k T token copies (1: balanced routing; the module's doc)."""
    if recompute == "full":
        return 0.0
    h, k, e, fm = cfg.hidden_size, cfg.moe_router_topk, cfg.num_experts, cfg.moe_ffn_size
    other = prec.other
    given = ROUTER_BYTES.get(cfg.moe_router_dtype or "")
    r = given or other
    w = max(r, 4)
    per_token = 0.0  # the router's, per token of this rank's slice of the sequence
    if cfg.moe_router_score_function == "sigmoid":
        per_token += e * 4 + 8 * k + ((k + 1) * r if k > 1 else 0)
    elif cfg.moe_router_pre_softmax:
        per_token += e * w + 8 * k
    else:
        per_token += k * (w + 8)
    once = e * h * given if given and given != weight_bytes else 0.0
    if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_score_function == "sigmoid":
        per_token += (e + 1) * r  # its scores (sigmoid) and their sums, which normalise them
        once += (e + 1) * r
    elif cfg.moe_aux_loss_coeff > 0:
        per_token += e * w
        once += (e + 1) * w
    if cfg.moe_z_loss_coeff:
        per_token += (e + 1) * r
        once += r
    # The router's input, its own copy in --moe-router-dtype or the norm's output (autocast's
    # 16-bit copy of an fp32 one), in place of what layer_bytes counted for the MLP's input
    # (the gathered norm output, or --recompute-modules mlp's checkpoint input).
    modules = recomputed_modules(cfg, recompute)
    per_token += h * r
    per_token *= 1 / tp if sp else 1.0
    per_token -= norm_outputs(cfg, tp, sp, prec, "mlp" in modules)[1]
    if "mlp" not in modules:  # layer_bytes counted a dense MLP's tensors
        per_token -= (4 if cfg.activation == "swiglu" else 2) * cfg.ffn_size / tp * other
    swiglu = cfg.activation == "swiglu"
    # Per token an expert got, over the gathered sequence on every rank: its input, its
    # output (the sum's index_add keeps its source, whose shape it needs), its MLP's tensors
    # over this rank's f/t, its routing weight and row index.
    expert = (5 if swiglu else 3) * fm / tp * other + r
    if ep == 1:
        per_token += k * (2 * h * other + expert + 8)
    else:  # sent: the returned output and two indices; received: the expert's saves
        per_token += k * (h * other + 16) + expert_tokens * k * (2 * h * other + expert + 16)
    return cfg.seq_length // cp * b * per_token + once
