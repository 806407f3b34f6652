"""GPU profile: where one GPT layer's forward and backward spend their GPU time, by kind of
kernel, beside `megart plan`'s layer_work for the same layer.

    python bench/layer_profile.py [--hidden 2048 --heads 16 --micro-batch 4] [--gpu h200]

The layer is megart's Block (bf16, seq 2048, flash attention through torch's SDPA, no tensor
parallelism). torch.profiler records `--steps` forward-only calls, then as many forward and
backward calls; each kernel's device time is put in a kind by its name (matrix products,
flash attention forward / backward, norms, activation, copies, other element-wise), and the
backward's share is the second profile less the first. Also times the attention core alone
(`scaled_dot_product_attention`, causal) forward and forward + backward with CUDA events.
Without a GPU it exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from gemm_sweep import block_and_input, median_ms  # bench/ is on the path as a script
from megart.models.config import GPTConfig
from megart.plan.hardware import load_profile
from megart.plan.timing import layer_work

KINDS = [  # (kind, substrings of the kernel's lower-cased name), first match wins
    ("norms", ("layer_norm", "layernorm", "rms_norm", "gammabeta")),
    ("activation", ("gelu",)),
    ("flash backward", ("flash_bwd", "fmha_bwd", "bprop", "dot_do_o", "convert_dq", "attn_bwd")),
    ("flash forward", ("flash", "fmha", "attention", "sdpa", "fprop")),
    ("matrix products", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "splitk")),
    ("copies", ("copy", "transpose", "cat", "elementwise_kernel_with_index")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other element-wise"


def kernel_ms(fn: Callable[[], object], steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per-step device milliseconds by kind, and by kernel name, of ``steps`` calls of ``fn``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us <= 0 or e.key.startswith(("ProfilerStep", "aten::", "cudaDevice")):
            continue
        by_kind[kind_of(e.key)] += us / 1e3 / steps
        by_name[e.key] += us / 1e3 / steps
    return by_kind, by_name


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gpu", default="h200")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_profile: no CUDA GPU", file=sys.stderr)
        return 2
    cfg = GPTConfig(
        vocab_size=256,
        seq_length=2048,
        hidden_size=args.hidden,
        num_layers=1,
        num_attention_heads=args.heads,
    )
    b, s, d = args.micro_batch, cfg.seq_length, cfg.head_dim
    block, x, grad = block_and_input(cfg, b)
    fwd, fwd_names = kernel_ms(lambda: block(x), args.steps)
    both, both_names = kernel_ms(lambda: block(x).backward(grad), args.steps)
    plan = layer_work(cfg, b, 1, False, None, load_profile(args.gpu))
    print(
        f"{torch.cuda.get_device_name()}: layer h {args.hidden}, {args.heads} heads, b {b}, s {s}"
    )
    print("| kernels | forward ms | backward ms | backward / forward |")
    print("|---|---|---|---|")
    for kind in sorted(set(fwd) | set(both), key=lambda k: -both.get(k, 0.0)):
        f, bw = fwd.get(kind, 0.0), both.get(kind, 0.0) - fwd.get(kind, 0.0)
        print(f"| {kind} | {f:.3f} | {bw:.3f} | {ratio(bw, f):.2f} |")
    f_all, b_all = sum(fwd.values()), sum(both.values()) - sum(fwd.values())
    print(f"| all | {f_all:.3f} | {b_all:.3f} | {ratio(b_all, f_all):.2f} |")
    print(
        f"| plan (layer_work) | {plan.forward * 1e3:.3f} | {plan.backward * 1e3:.3f} |"
        f" {plan.backward / plan.forward:.2f} |"
    )
    print("backward kernels (both profile less forward), largest first:")
    back = {n: both_names[n] - fwd_names.get(n, 0.0) for n in both_names}
    for name, ms in sorted(back.items(), key=lambda kv: -kv[1])[:18]:
        print(f"  {ms:8.3f} ms  [{kind_of(name)}] {name[:110]}")
    print("forward kernels, largest first:")
    for name, ms in sorted(fwd_names.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {ms:8.3f} ms  [{kind_of(name)}] {name[:110]}")
    # The attention core alone, in the layout the layer hands it.
    q, k, v = (
        torch.randn(b, args.heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dy = torch.randn_like(q)
    core_f = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    core_fb = median_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dy)
    )
    print(
        f"attention core alone (sdpa, causal, d {d}): forward {core_f:.3f} ms, backward"
        f" {core_fb - core_f:.3f} ms, backward / forward {(core_fb - core_f) / core_f:.2f};"
        f" forward {2 * b * args.heads * s * s * d / (core_f * 1e-3) / 1e12:.0f} TFLOP/s"
        " counting every s x s product, the causally skipped half too"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
