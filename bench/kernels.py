"""GPU benchmark: megart's fused kernels against torch eager doing the same math unfused.

Run as ``python bench/kernels.py [--json FILE]`` on a machine with a CUDA GPU and megart built
with CUDA. For each op, dtype and GPT-sized shape it first checks that the fused result equals
torch's (and stops with status 1 if one does not), then times forward and forward+backward of
both with CUDA events: warm-up calls, then rounds that alternate the two (so clock drift hits
both alike), each round the mean of several calls; medians over rounds are reported, with
speedup = eager / fused. Without a GPU it exits with status 2.

The ops and their eager baselines (what the flags replace):
- bias_gelu (--bias-gelu-fusion): ``F.gelu(y + bias, approximate="tanh")``, y [tokens, 4h];
- add_layer_norm (--fused-layer-norm): ``s = x + r; F.layer_norm(s)``, [tokens, h];
- cross_entropy (--cross-entropy-loss-fusion): megart.tensor_parallel's unfused
  vocab_parallel_cross_entropy on logits [tokens, 50304 / t] (no group: one rank's share).

The fused cross-entropy writes its gradient into the logits, so forward+backward of both takes
the gradient of a view of one logits tensor (torch.autograd.grad, nothing accumulated); the
fused op leaves gradient values in it, which costs the same to process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import megart
import megart.tensor_parallel as tp
from megart.kernels import add_layer_norm, bias_gelu, fused_vocab_parallel_cross_entropy
from megart.kernels._dispatch import cuda_kernel

Fn = Callable[[], object]
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def bias_gelu_case(tokens: int, width: int, dtype: torch.dtype) -> dict[str, Fn]:
    y = torch.randn(tokens, width, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(width, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn_like(y)
    return {
        "eager fwd": lambda: F.gelu(y + b, approximate="tanh"),
        "fused fwd": lambda: bias_gelu(y, b),
        "eager fwd+bwd": lambda: torch.autograd.grad(F.gelu(y + b, approximate="tanh"), (y, b), g),
        "fused fwd+bwd": lambda: torch.autograd.grad(bias_gelu(y, b), (y, b), g),
    }


def layer_norm_case(tokens: int, h: int, dtype: torch.dtype) -> dict[str, Fn]:
    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)

    x, r, w, b = make(tokens, h), make(tokens, h), make(h), make(h)
    g_out, g_sum = torch.randn_like(x), torch.randn_like(x)

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        s = x + r
        return F.layer_norm(s, (h,), w, b, 1e-5), s

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        return add_layer_norm(x, r, w, b, 1e-5)

    return {
        "eager fwd": eager,
        "fused fwd": fused,
        "eager fwd+bwd": lambda: torch.autograd.grad(eager(), (x, r, w, b), (g_out, g_sum)),
        "fused fwd+bwd": lambda: torch.autograd.grad(fused(), (x, r, w, b), (g_out, g_sum)),
    }


def cross_entropy_case(tokens: int, vocab: int, dtype: torch.dtype) -> dict[str, Fn]:
    base = (torch.randn(tokens, vocab, device="cuda") * 4).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    g = torch.full((tokens,), 1.0 / tokens, device="cuda")

    def eager() -> torch.Tensor:
        return tp.vocab_parallel_cross_entropy(base.view_as(base), target, None)

    def fused() -> torch.Tensor:
        return fused_vocab_parallel_cross_entropy(base.view_as(base), target, None)

    return {
        "eager fwd": eager,
        "fused fwd": fused,
        "eager fwd+bwd": lambda: torch.autograd.grad(eager(), base, g),
        "fused fwd+bwd": lambda: torch.autograd.grad(fused(), base, g),
    }


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def rel_error(a: object, b: object) -> float:
    """Largest ||a - b|| / ||b|| over the tensors of two results."""
    pairs = zip(a, b, strict=True) if isinstance(a, tuple | list) else [(a, b)]
    worst = 0.0
    for x, y in pairs:
        x, y = x.double(), y.double()
        worst = max(worst, ((x - y).norm() / y.norm().clamp_min(1e-30)).item())
    return worst


def time_ms(fn: Fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def run_case(fns: dict[str, Fn], mode: str, rounds: int, iters: int) -> dict[str, float]:
    eager, fused = fns[f"eager {mode}"], fns[f"fused {mode}"]
    for fn in (eager, fused):  # warm-up: allocator, autotuning, clocks
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {"eager": [], "fused": []}
    for i in range(rounds):
        order = (("eager", eager), ("fused", fused))
        for name, fn in order if i % 2 == 0 else order[::-1]:
            times[name].append(time_ms(fn, iters))
    eager_ms, fused_ms = statistics.median(times["eager"]), statistics.median(times["fused"])
    return {"eager_ms": eager_ms, "fused_ms": fused_ms, "speedup": eager_ms / fused_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="bias_gelu,add_layer_norm,cross_entropy")
    parser.add_argument("--tokens", default="8192,16384", help="tokens per step (s x b)")
    parser.add_argument("--hidden", default="2048,4096", help="model hidden sizes h")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tp", default="1,8", help="tensor-parallel sizes (vocab / t per rank)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--iters", type=int, default=10, help="calls per timed round")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()

    probe = torch.zeros(1, device="cuda") if torch.cuda.is_available() else torch.zeros(1)
    if cuda_kernel("bias_gelu_forward", probe) is None:
        print(
            "bench/kernels.py: needs a CUDA GPU and megart built with CUDA (megart._cuda); "
            f"found torch.cuda.is_available()={torch.cuda.is_available()}, "
            f"megart cuda_compiled={megart.build_info()['cuda_compiled']}",
            file=sys.stderr,
        )
        return 2

    cases = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for op in args.ops.split(","):
            for tokens in ints(args.tokens):
                if op == "cross_entropy":
                    widths = [args.vocab // t for t in ints(args.tp)]
                else:
                    widths = [4 * h if op == "bias_gelu" else h for h in ints(args.hidden)]
                cases += [(op, dtype_name, dtype, tokens, w) for w in widths]
    make = {
        "bias_gelu": bias_gelu_case,
        "add_layer_norm": layer_norm_case,
        "cross_entropy": cross_entropy_case,
    }
    # Results within these of torch's, or the benchmark stops: a wrong kernel has no speed.
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, megart {megart.__version__}")
    header = ("op", "dtype", "shape", "mode", "eager ms", "fused ms", "speedup")
    print("{:<15}{:<10}{:>15}  {:<8}{:>10}{:>10}{:>9}".format(*header))
    results = []
    for op, dtype_name, dtype, tokens, width in cases:
        torch.manual_seed(0)
        fns = make[op](tokens, width, dtype)
        err = rel_error(fns["fused fwd"](), fns["eager fwd"]())
        expected = fns["eager fwd+bwd"]()  # before the fused cross-entropy overwrites its input
        grads_err = rel_error(fns["fused fwd+bwd"](), expected)
        del expected
        if max(err, grads_err) > tolerance[dtype]:
            print(
                f"MISMATCH {op} {dtype_name} [{tokens}, {width}]: forward rel. error {err:.2e}, "
                f"gradients {grads_err:.2e} (limit {tolerance[dtype]:.0e}); not timed",
                file=sys.stderr,
            )
            return 1
        for mode in ("fwd", "fwd+bwd"):
            r = run_case(fns, mode, args.rounds, args.iters)
            shape = f"{tokens}x{width}"
            print(
                f"{op:<15}{dtype_name:<10}{shape:>15}  {mode:<8}{r['eager_ms']:>10.3f}"
                f"{r['fused_ms']:>10.3f}{r['speedup']:>8.2f}x"
            )
            results.append(
                {"op": op, "dtype": dtype_name, "tokens": tokens, "width": width, "mode": mode}
                | r
                | {"fwd_rel_error": err, "grad_rel_error": grads_err}
            )
        del fns
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
            json.dump({"benchmark": "fused_kernels", **meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
