"""GPU diagnosis: where one fused op's forward+backward time goes, host against GPU.

Run as ``python bench/kernel_profile.py [--op add_layer_norm] [--tokens 8192] [--hidden 2048]
[--dtype bfloat16]`` on a machine with a CUDA GPU. For eager and fused (bench/kernels.py's
cases) it reports, per call of forward+backward:

- ``wall``: N calls back to back, one synchronize, CUDA events (what bench/kernels.py times);
- ``host``: the Python/C++ time to enqueue one call (perf_counter around N calls, no sync):
  when host >= GPU, the wall time is the host's and a faster kernel cannot show;
- ``gpu``: the sum of the GPU kernels' times of one call, from torch.profiler;

then the profiler's table of the fused call's operators, by CPU time. Without a GPU it exits
with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kernels import DTYPES, bias_gelu_case, layer_norm_case, time_ms  # bench/kernels.py

CASES = {"add_layer_norm": layer_norm_case, "bias_gelu": bias_gelu_case}


def host_us(fn: object, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / iters * 1e6


def gpu_us(fn: object, iters: int) -> tuple[float, object]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    return total / iters, events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(CASES), default="add_layer_norm")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_profile: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    fns = CASES[args.op](args.tokens, args.hidden, DTYPES[args.dtype])
    print(f"{args.op} {args.dtype} {args.tokens}x{args.hidden}, fwd+bwd, us per call")
    print(f"{'':8}{'wall':>10}{'host':>10}{'gpu':>10}")
    fused_events = None
    for name in ("eager", "fused"):
        fn = fns[f"{name} fwd+bwd"]
        for _ in range(5):
            fn()
        wall = time_ms(fn, args.iters) * 1e3
        host = host_us(fn, args.iters)
        gpu, events = gpu_us(fn, args.iters)
        print(f"{name:8}{wall:>10.1f}{host:>10.1f}{gpu:>10.1f}")
        fused_events = events
    print(fused_events.table(sort_by="cpu_time_total", row_limit=14))
    return 0


if __name__ == "__main__":
    sys.exit(main())
