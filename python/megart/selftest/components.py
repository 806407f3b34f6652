"""Single-process checks, each written for any device: the C++ core, megart's AdamW against
torch's, every fused kernel against its torch reference at every dtype. On CPU the kernels take
their torch path, so there the check exercises only this file's logic; on a GPU it checks the
CUDA kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megart.selftest.report import Check, judged, relative_error, timed

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Kernel outputs against a float64 torch reference: the dtype's rounding, a few ulps of it.
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def check_core() -> list[Check]:
    """The C++ core: the 1F1B schedule's simulated bubble against the theory (p-1)/m (idle
    time over compute time), and the multi-tensor sum of squares against float64 torch."""
    from megart import schedule
    from megart.optim.clip import grad_sum_of_squares

    p, m = 4, 8
    sim = schedule.simulate(schedule.build("1f1b", stages=p, microbatches=m))
    bubble_error = abs(sim.bubble_fraction - (p - 1) / m) / ((p - 1) / m)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) for n in (1, 1000, 65537)]
    got = grad_sum_of_squares(grads)
    want = sum((t.double() ** 2).sum() for t in grads)
    t_core = timed(lambda: grad_sum_of_squares(grads))
    t_torch = timed(lambda: sum((t * t).sum() for t in grads))
    return [
        judged("core: 1f1b schedule simulator", bubble_error, 1e-12, what="bubble vs theory, "),
        judged(
            "core: multi-tensor sum of squares",
            relative_error(got.reshape(()), want),
            1e-6,
            t_core / t_torch,
        ),
    ]


def check_adamw(device: torch.device, steps: int = 5) -> list[Check]:
    """megart.optim.AdamW against torch.optim.AdamW (fused=True on a GPU) over a few steps on
    the same parameters and gradients, fp32."""
    import megart.optim

    g = torch.Generator().manual_seed(1)
    shapes = [(257, 129), (1000,), (3,)]
    start = [torch.randn(s, generator=g).to(device) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(device) for s in shapes] for _ in range(steps)]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def run(make: Callable[..., torch.optim.Optimizer]) -> tuple[list[torch.Tensor], float]:
        params = [torch.nn.Parameter(s.clone()) for s in start]
        opt = make(params, **kw)

        def step(i: list[int] = [0]) -> None:  # noqa: B006 - a step counter across calls
            for p, gr in zip(params, grads[i[0] % steps], strict=True):
                p.grad = gr
            opt.step()
            i[0] += 1

        for _ in range(steps):
            step()
        result = [p.detach().clone() for p in params]
        return result, timed(step, 3)

    fused = device.type == "cuda"
    ref, t_ref = run(lambda ps, **k: torch.optim.AdamW(ps, fused=fused or None, **k))
    got, t_got = run(megart.optim.AdamW)
    err = max(relative_error(a, b) for a, b in zip(got, ref, strict=True))
    name = "AdamW (CUDA multi-tensor)" if fused else "AdamW (C++ multi-tensor)"
    what = f"{steps} steps vs torch.optim.AdamW{'(fused=True)' if fused else ''}, "
    # On a GPU `megart train` steps with torch's fused AdamW, so no flag is needed to avoid it.
    return [judged(name, err, 1e-5, t_got / t_ref, None, what)]


@dataclass
class Kernel:
    """A fused kernel: ``run(inputs)`` megart's outputs, ``reference(inputs)`` torch's (the
    inputs are given in float64 to the reference), ``flag`` what turns it on in megart train,
    ``on_by_default`` whether megart train uses it unasked (then --no-FLAG avoids it)."""

    name: str
    make: Callable[[torch.dtype, torch.device], list[torch.Tensor]]
    run: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    flag: str
    on_by_default: bool = False

    def avoid(self) -> str:
        """How megart train runs without this kernel."""
        if self.on_by_default:
            return "--no-" + self.flag.removeprefix("--")
        return f"no {self.flag} (it is off by default)"


def _rows(dtype: torch.dtype, device: torch.device, *cols: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(64, c, generator=g).to(dtype=dtype, device=device) for c in cols]


def _ln_inputs(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    x, r = _rows(dtype, device, 1024, 1024)
    w, b = _rows(dtype, device, 1024, 1024)
    return [x, r, w[0].contiguous(), b[0].contiguous()]


def _ce_inputs(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    (logits,) = _rows(dtype, device, 4096)
    target = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(3))
    return [logits, target.to(device)]


def _ce_megart(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from megart.kernels import fused_vocab_parallel_cross_entropy

    return fused_vocab_parallel_cross_entropy(logits.clone(), target, None)


def _bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from megart.kernels import bias_gelu

    return bias_gelu(x, b)


def _add_ln(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from megart.kernels import add_layer_norm

    return add_layer_norm(x, r, w, b, 1e-5)[0]


KERNELS = (
    Kernel(
        "bias_gelu",
        lambda d, dev: [_rows(d, dev, 1024)[0], _rows(d, dev, 1024)[0][0].contiguous()],
        _bias_gelu,
        lambda x, b: F.gelu(x + b, approximate="tanh"),
        "--bias-gelu-fusion",
        on_by_default=True,
    ),
    Kernel(
        "add_layer_norm",
        _ln_inputs,
        _add_ln,
        lambda x, r, w, b: F.layer_norm(x + r, (x.shape[-1],), w, b, 1e-5),
        "--fused-layer-norm",
    ),
    Kernel(
        "vocab-parallel cross-entropy",
        _ce_inputs,
        _ce_megart,
        lambda logits, target: F.cross_entropy(logits, target, reduction="none"),
        "--cross-entropy-loss-fusion",
    ),
)


def _forward_backward_error(k: Kernel, inputs: list[torch.Tensor]) -> float:
    """The larger relative error of the output and of every input's gradient (for the same
    upstream gradient) against the reference run on float64 copies of the inputs."""
    mine = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    wide = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    got, want = k.run(*mine), k.reference(*wide)
    err = relative_error(got, want)
    if not torch.isfinite(got).all():
        return float("inf")
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(4))
    got.backward(upstream.to(dtype=got.dtype, device=got.device))
    want.backward(upstream.to(dtype=want.dtype, device=want.device))
    for a, b in zip(mine, wide, strict=True):
        if a.requires_grad:
            err = max(err, relative_error(a.grad, b.grad))
    return err


def check_kernels(
    device: torch.device, kernels: tuple[Kernel, ...] = KERNELS, dtypes: tuple = DTYPES
) -> list[Check]:
    """Each kernel's forward and backward at each dtype against torch in float64; its forward
    time over torch eager at the same dtype. A failure names the flag to leave off."""
    checks = []
    for k in kernels:
        for dtype in dtypes:
            inputs = k.make(dtype, device)
            err = _forward_backward_error(k, inputs)
            t_got = timed(lambda k=k, i=inputs: k.run(*i), 3)
            t_ref = timed(lambda k=k, i=inputs: k.reference(*i), 3)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = str(dtype).removeprefix("torch.")
            checks.append(
                judged(
                    f"kernel {k.name} {dt}",
                    err,
                    KERNEL_TOLERANCE[dtype],
                    t_got / max(t_ref, 1e-9),
                    k.avoid(),
                    f"on {device.type}, ",
                )
            )
    return checks


def _accumulate(weight: torch.nn.Parameter, batches: list, dtype: torch.dtype, fused: bool) -> None:
    """A linear layer's forward and backward over ``batches`` (x, dy) into a zeroed ``.grad``,
    as megart train runs them: under autocast to ``dtype``, in one fusion region (or none)."""
    from megart.tensor_parallel import weight_grad

    weight.grad = torch.zeros_like(weight)
    autocast = torch.autocast(weight.device.type, dtype, enabled=dtype != torch.float32)
    with autocast, weight_grad.fusing_accumulation(fused):
        for x, dy in batches:
            weight_grad.linear(x, weight).backward(dy)


def check_grad_accumulation_fusion(device: torch.device) -> list[Check]:
    """Gradient accumulation fusion (on by default in megart train): one linear layer's weight
    gradient over three microbatches under autocast, added into an fp32 ``.grad`` by the
    product itself, against the float64 sum; its time over the unfused path (a 16-bit product,
    a cast, an add). In fp32 and on torch's mixed-dtype product the sum is accumulated in fp32
    (1e-5); a torch without that product (before 2.8) keeps the 16-bit rounding, judged as the
    kernels are."""
    from megart.tensor_parallel import weight_grad

    tokens, width = (4096, 2048) if device.type == "cuda" else (256, 256)
    g = torch.Generator().manual_seed(5)
    checks = []
    for dtype in DTYPES:
        batches = [
            (torch.randn(tokens, width, generator=g), torch.randn(tokens, width, generator=g))
            for _ in range(3)
        ]
        batches = [(x.to(device), dy.to(device=device, dtype=dtype)) for x, dy in batches]
        weight = torch.nn.Parameter(torch.randn(width, width, generator=g).to(device))

        _accumulate(weight, batches, dtype, fused=True)
        want = sum(dy.double().t() @ x.to(dtype).double() for x, dy in batches)
        err = relative_error(weight.grad, want)
        fused, plain = (
            timed(lambda f=f, w=weight, b=batches, d=dtype: _accumulate(w, b, d, f), 3)
            for f in (True, False)
        )
        ratio = fused / max(plain, 1e-9)
        fp32_sum = dtype == torch.float32 or device.type == "cpu" or weight_grad.MIXED_PRODUCT
        dt = str(dtype).removeprefix("torch.")
        checks.append(
            judged(
                f"gradient accumulation fusion {dt}",
                err,
                1e-5 if fp32_sum else KERNEL_TOLERANCE[dtype],
                ratio,
                "--no-gradient-accumulation-fusion",
                f"on {device.type}, 3 microbatches vs float64, ",
            )
        )
    return checks
