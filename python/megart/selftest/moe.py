"""The mixture-of-experts layer (megart.models.moe.MoE) on this device, as megart train runs it:
in training mode with the load-balancing loss and the z-loss on and their gradients scaled by
AuxLossScale (as the engine sets it for a run of 4 microbatches), in fp32 and under bf16
autocast with fp32 weights, a 16-bit input (--bf16's residual stream) and gradient accumulation
fusion into zeroed gradient buffers (megart train's defaults). Its output and the gradients of
its input, router weight and every expert's weights are compared with the same layer's (the
same weights) in float64 on the CPU, for the same upstream gradient.

Routing cannot flip between the device and the reference, so the check is not flaky: the
router's weight has orthonormal rows and each token is drawn with its logits prescribed, a
permutation of values 0.6 apart plus at most 0.1 of jitter, so that any two experts' logits
differ by 0.4 or more, while bf16's rounding moves a logit here by 3e-2 at most (2^-8 of
sum |x_i w_i| for the product's rounded inputs, 2^-9 of |logit| for its output; 9e-3 seen)
and fp32's by some 1e-6. A monotone score (softmax, sigmoid, |logit| <= 1.1 far from its
saturation) keeps that order, so every top-k choice, the router's and the load-balancing
loss's, is decided with room to spare. The check reads the experts the device chose (route()
on the logits the device's router gave) and fails, naming the count, if any token went to
other experts than in the float64 layer: with that separation it is a fault, never a tie.

One case routes no token to the last expert (its logit is always the lowest) and runs without
gradient buffers, so autograd itself must give that expert's weights zero gradients: None fails
by name, and a nonzero one fails against the reference's zeros.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from megart.models.config import GPTConfig
from megart.models.moe import AuxLossScale, MoE, route
from megart.selftest.report import Check, judged, relative_error
from megart.tensor_parallel.weight_grad import fusing_accumulation

DTYPES = (torch.float32, torch.bfloat16)
# Against float64, relative to each tensor's largest entry. fp32: a few ulps of sums of some
# 100 terms (1e-6 seen on the CPU). bf16: every product's inputs and output rounded to 8 bits
# (unit roundoff 2^-9 = 2e-3), some 4 products in a row forward (router, fc and gate, the
# routing weight's scale, proj) and as many again backward, each error carried into the next:
# 1e-2 seen on the CPU; 5e-2 leaves room for CUDA's other summation orders.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
LOSS_FACTOR = 0.25  # 1/m for 4 microbatches: the loss's factor, and so AuxLossScale's
SEQUENCE, BATCH = 32, 4
LOGIT_STEP, JITTER = 0.6, 0.1  # logits of one token: a permutation of steps apart, +- jitter

# Coefficients large enough that the auxiliary losses' gradients weigh in the router's against
# the upstream gradient of a mean loss over the tokens: the z-loss's 15% to 28% of it, the
# load-balancing loss's 0.8% to 14% (least where the experts' loads are nearly even).
BASE = dict(
    vocab_size=128, seq_length=SEQUENCE, hidden_size=64, num_layers=1, num_attention_heads=4,
    ffn_hidden_size=128, bias=False, init_std=0.1, num_experts=4,
    moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1,
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """A layer configuration; ``idle``: the last expert gets no token, and the layer runs
    without gradient buffers (autograd makes the gradients)."""

    name: str
    fields: dict = field(default_factory=dict)
    idle: bool = False

    def config(self) -> GPTConfig:
        return GPTConfig(**{**BASE, **self.fields})


CASES = (
    Case("top-2 softmax"),
    Case("top-1 pre-softmax", dict(moe_router_topk=1, moe_router_pre_softmax=True)),
    Case(
        "sigmoid top-2 scaled, fp32 router",
        dict(
            moe_router_score_function="sigmoid",
            moe_router_topk_scaling_factor=2.5,
            moe_router_dtype="fp32",
        ),
    ),
    Case("swiglu top-2", dict(activation="swiglu", moe_ffn_hidden_size=96)),
    Case("top-2, an expert without tokens", idle=True),
)


def drawn(case: Case) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    """The layer (float64, on the CPU, its router replaced by orthonormal rows), an input
    [s, b, h] whose router logits are prescribed (well apart; see the module docstring) and the
    upstream gradient of a mean loss over the tokens, times LOSS_FACTOR."""
    cfg = case.config()
    g = torch.Generator().manual_seed(7)
    h, e, tokens = cfg.hidden_size, cfg.num_experts, SEQUENCE * BATCH
    layer = MoE(cfg, 0, _scale()).double()
    q = torch.linalg.qr(torch.randn(h, e, generator=g, dtype=torch.float64))[0]  # [h, e]
    layer.router.weight.data.copy_(q.t())
    steps = (torch.arange(e, dtype=torch.float64) - (e - 1) / 2) * LOGIT_STEP
    order = torch.stack([torch.randperm(e, generator=g) for _ in range(tokens)])
    if case.idle:  # the last expert always gets the lowest logit: no top-k holds it
        order = torch.stack([torch.randperm(e - 1, generator=g) + 1 for _ in range(tokens)])
        order = torch.cat([order, torch.zeros(tokens, 1, dtype=order.dtype)], dim=1)
    jitter = (torch.rand(tokens, e, generator=g, dtype=torch.float64) * 2 - 1) * JITTER
    logits = steps[order] + jitter
    x = torch.randn(tokens, h, generator=g, dtype=torch.float64)
    x = x - (x @ q) @ q.t() + logits @ q.t()  # x q = logits
    dy = torch.randn(SEQUENCE, BATCH, h, generator=g, dtype=torch.float64) * LOSS_FACTOR / tokens
    return layer, x.view(SEQUENCE, BATCH, h), dy


def _scale() -> AuxLossScale:
    scale = AuxLossScale()
    scale.value = LOSS_FACTOR
    return scale


@dataclass
class Result:
    """One run: the output, the gradients by name ("input", then the parameters'; None where
    none came), and which experts each token went to ([T, E] bool)."""

    out: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    chosen: torch.Tensor


def run(
    layer: MoE,
    x: torch.Tensor,
    dy: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
    buffers: bool = True,
) -> Result:
    """A copy of ``layer`` (fp32 weights; float64 ones for ``dtype`` float64) trained one step
    on ``device``: forward on ``x`` in ``dtype`` (under autocast for a 16-bit one), backward from
    ``dy``, inside gradient accumulation fusion; ``buffers``: into zeroed gradients, as megart
    train's, else autograd's own."""
    weights = torch.float64 if dtype == torch.float64 else torch.float32
    mine = copy.deepcopy(layer).to(device=device, dtype=weights).train()
    if weights == torch.float64 and mine.router.dtype is not None:
        mine.router.dtype = torch.float64  # the reference: --moe-router-dtype fp32 in float64
    if buffers:
        for p in mine.parameters():
            p.grad = torch.zeros_like(p)
    logits: list[torch.Tensor] = []
    hook = mine.router.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
    inp = x.detach().to(device=device, dtype=dtype).requires_grad_()
    half = dtype not in (torch.float32, torch.float64)
    try:
        with torch.autocast(device.type, dtype, enabled=half), fusing_accumulation():
            out = mine(inp)
            out.backward(dy.to(device=device, dtype=out.dtype))
    finally:
        hook.remove()
    grads = {"input": inp.grad, **{n: p.grad for n, p in mine.named_parameters()}}
    return Result(out.detach(), grads, route(logits[0], mine.cfg)[1].cpu())


def compare(got: Result, want: Result) -> tuple[float, str]:
    """The largest relative error over the output and every gradient, and what is wrong
    beyond it ("" if nothing): tokens routed otherwise, gradients missing."""
    if not torch.equal(got.chosen, want.chosen):
        n = int((got.chosen != want.chosen).any(dim=1).sum())
        return float("inf"), f"{n} of {len(got.chosen)} tokens routed unlike float64; "
    missing = [n for n, g in got.grads.items() if g is None]
    if missing:
        return float("inf"), f"no gradient (None) for {', '.join(missing)}; "
    err = relative_error(got.out, want.out)
    for name, g in got.grads.items():
        err = max(err, relative_error(g, want.grads[name]))
    return err, ""


def check_moe(device: torch.device, cases: tuple[Case, ...] = CASES) -> list[Check]:
    """Each case in fp32 and bf16 on ``device`` against float64 on the CPU."""
    checks = []
    for case in cases:
        layer, x, dy = drawn(case)
        want = run(layer, x, dy, torch.device("cpu"), torch.float64, buffers=not case.idle)
        for dtype in DTYPES:
            got = run(layer, x, dy, device, dtype, buffers=not case.idle)
            err, wrong = compare(got, want)
            idle = [e for e in range(got.chosen.shape[1]) if not got.chosen[:, e].any()]
            dt = str(dtype).removeprefix("torch.")
            what = (
                f"{wrong}on {device.type}, {len(got.chosen)} tokens"
                + (f" (none to expert {', '.join(map(str, idle))})" if idle else "")
                + ", output and gradients (input, router, experts) vs float64, "
            )
            checks.append(judged(f"moe {case.name} {dt}", err, TOLERANCE[dtype], what=what))
    return checks
