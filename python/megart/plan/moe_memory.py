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

in place of the dense MLP's 2 f or 4 f. Every expert term is per token an expert got, and the
experts' counts add up to k T whatever the routing, so the bytes do not depend on which expert
got which token: exact, not an estimate of the routing (measured with the experts' actual
counts by the same hooks). What may differ on a GPU: nothing that is kernel-specific here (no
fused kernel runs in an MoE layer).

Recomputation: full recomputation keeps an MoE layer's input like any layer's and replays all
of the above. --recompute-modules mlp checkpoints dense MLPs only (models.blocks, as
Megatron-Core's "mlp"): an MoE layer keeps its whole saves, and its norm output is the router's
input rather than a checkpoint's. --recompute-modules layernorm with MoE layers is refused
(plan.flags: megart train cannot run it yet).
"""

from __future__ import annotations

from megart.models.config import GPTConfig
from megart.models.recompute import recomputed_modules
from megart.plan.activations import Precision

ROUTER_BYTES = {"fp32": 4, "fp64": 8}


def moe_layer_extra(
    cfg: GPTConfig,
    b: int,
    recompute: str | None,
    prec: Precision,
    cp: int = 1,
    weight_bytes: int = 4,
) -> float:
    """Bytes an MoE layer keeps for one microbatch beyond activations.layer_bytes' count of a
    dense layer under ``recompute`` (none under full recomputation: the layer's input alone,
    as a dense layer's); at tensor-parallel size 1, the one the plan models (plan.flags).
    ``weight_bytes``: the weights' (2 under --half-weights), which --moe-router-dtype's cast of
    the router's weight copies when they differ."""
    if recompute == "full":
        return 0.0
    h, k, e, fm = cfg.hidden_size, cfg.moe_router_topk, cfg.num_experts, cfg.moe_ffn_size
    other = prec.other
    given = ROUTER_BYTES.get(cfg.moe_router_dtype or "")
    r = given or other
    w = max(r, 4)
    per_token = h * (given - other) if given else 0.0  # the router's own copy of its input
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
    swiglu = cfg.activation == "swiglu"
    # Each expert's output too: the sum's index_add keeps its source (whose shape it needs).
    per_token += k * (2 * h * other + (5 if swiglu else 3) * fm * other + r + 8)
    modules = recomputed_modules(cfg, recompute)
    if "mlp" in modules:  # layer_bytes counted a checkpoint's input and no MLP tensors
        per_token += h * (other - prec.residual)
    else:
        per_token -= (4 if swiglu else 2) * cfg.ffn_size * other
    return cfg.seq_length // cp * b * per_token + once
