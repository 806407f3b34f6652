"""GPU benchmark: `megart plan`'s cost model against measured work on this GPU.

    python bench/gemm_sweep.py [--gpu h200] [--json FILE]

1. Matrix products. The planner times a product at peak x e(m), e(m) = e_max x m / (m + m_1/2),
   m its smallest dimension (megart/plan/timing.py). Here bf16 `torch.mm` runs with one
   dimension m (16 to 8192) and the other two 8192, m in each of the three places, and the
   attention core's per-head products (`torch.bmm`, sequence 2048, head size 64 and 128). Each
   row gives the measured fraction of the profile's peak beside the profile's e(m), and the
   (e_max, m_1/2) that fit the measured dense rows best (least squares in log time), so the
   profile's two fitted constants can be checked against this GPU instead of against
   published tables.
2. One GPT layer (megart's Block, bf16, flash attention through torch's SDPA, no tensor
   parallelism) at three sizes: measured forward and backward beside the planner's
   `layer_work`, and the measured backward / forward ratio (the planner's: 2 for the products
   and element-wise work, 2.5 for flash attention's core).

Times are CUDA-event medians over rounds after warm-up calls at every shape. Without a GPU it
exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable

import torch

from megart.models.blocks import Block
from megart.models.config import GPTConfig
from megart.plan.hardware import load_profile
from megart.plan.timing import layer_work

SMALL = [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192]
BIG = 8192
DEVICE = "cuda"
LAYERS = [(2048, 16, 4), (4096, 32, 2), (6144, 48, 1)]  # (hidden, heads, micro batch), seq 2048


def median_ms(fn: Callable[[], object], warmup: int = 3, rounds: int = 7, calls: int = 5) -> float:
    """Median over rounds of the mean time of ``calls`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def model_eff(m: float, e_max: float, half: float) -> float:
    return e_max * m / (m + half)


def products(peak: float) -> list[dict]:
    rows = []
    for place in ("rows", "cols", "inner"):
        for m in SMALL:
            dims = {"rows": BIG, "cols": BIG, "inner": BIG, place: m}
            a = torch.randn(dims["rows"], dims["inner"], device=DEVICE, dtype=torch.bfloat16)
            b = torch.randn(dims["inner"], dims["cols"], device=DEVICE, dtype=torch.bfloat16)
            ms = median_ms(lambda a=a, b=b: torch.mm(a, b))
            flops = 2 * dims["rows"] * dims["cols"] * dims["inner"]
            rows.append(
                {"kind": f"mm, {place} = m", "m": m, "ms": ms, "eff": flops / (ms * 1e-3) / peak}
            )
    for d in (64, 128):
        s, batch = 2048, 64  # e.g. 16 heads x micro batch 4
        q = torch.randn(batch, s, d, device=DEVICE, dtype=torch.bfloat16)
        kt = torch.randn(batch, d, s, device=DEVICE, dtype=torch.bfloat16)
        p = torch.randn(batch, s, s, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn(batch, s, d, device=DEVICE, dtype=torch.bfloat16)
        for name, x, y in (("scores q k^T", q, kt), ("probs x v", p, v)):
            ms = median_ms(lambda x=x, y=y: torch.bmm(x, y))
            flops = 2 * batch * s * s * d
            rows.append(
                {
                    "kind": f"bmm {name}, d = {d}",
                    "m": d,
                    "ms": ms,
                    "eff": flops / (ms * 1e-3) / peak,
                }
            )
    return rows


def fit(rows: list[dict]) -> tuple[float, float]:
    """(e_max, m_1/2) minimising the squared log error of the dense rows' times."""
    dense = [r for r in rows if r["kind"].startswith("mm")]
    best = (math.inf, 0.0, 0.0)
    for half in range(4, 1025, 4):
        # For a fixed m_1/2, the best e_max in log space is the geometric mean of the ratios.
        logs = [math.log(r["eff"] / model_eff(r["m"], 1.0, half)) for r in dense]
        e_max = math.exp(statistics.fmean(logs))
        err = sum((lg - math.log(e_max)) ** 2 for lg in logs)
        best = min(best, (err, e_max, half))
    return best[1], best[2]


def block_and_input(cfg: GPTConfig, b: int) -> tuple[Block, torch.Tensor, torch.Tensor]:
    """One bf16 Block (no tensor parallelism), an input [s, b, h] that wants its gradient, and
    a gradient for the Block's output."""
    block = Block(cfg, 0, None, False).to(DEVICE, torch.bfloat16)
    x = torch.randn(cfg.seq_length, b, cfg.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    x.requires_grad_(True)
    return block, x, torch.randn_like(x)


def layer_ms(cfg: GPTConfig, b: int) -> tuple[float, float]:
    """Measured forward and backward milliseconds of one Block."""
    block, x, grad = block_and_input(cfg, b)
    fwd = median_ms(lambda: block(x))
    both = median_ms(lambda: block(x).backward(grad))
    return fwd, both - fwd


def layers(gpu_name: str) -> list[dict]:
    gpu = load_profile(gpu_name)
    out = []
    for h, heads, b in LAYERS:
        cfg = GPTConfig(
            vocab_size=256, seq_length=2048, hidden_size=h, num_layers=1, num_attention_heads=heads
        )
        fwd, bwd = layer_ms(cfg, b)
        torch.cuda.empty_cache()
        plan = layer_work(cfg, b, 1, False, None, gpu)
        out.append(
            {
                "hidden": h,
                "heads": heads,
                "micro_batch": b,
                "forward_ms": fwd,
                "backward_ms": bwd,
                "plan_forward_ms": plan.forward * 1e3,
                "plan_backward_ms": plan.backward * 1e3,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200", help="megart plan profile to compare with")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_sweep: no CUDA GPU", file=sys.stderr)
        return 2
    gpu = load_profile(args.gpu)
    peak = gpu.peak_tflops * 1e12
    rows = products(peak)
    e_max, half = fit(rows)
    print(
        f"{torch.cuda.get_device_name()}; profile {gpu.name}: peak {gpu.peak_tflops:g} TFLOP/s,"
        f" e_max {gpu.gemm_efficiency_max}, m_1/2 {gpu.gemm_half_dim}"
    )
    print("| product | m | ms | measured / peak | profile e(m) | fitted e(m) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        prof = model_eff(r["m"], gpu.gemm_efficiency_max, gpu.gemm_half_dim)
        print(
            f"| {r['kind']} | {r['m']} | {r['ms']:.3f} | {r['eff']:.3f} | {prof:.3f} |"
            f" {model_eff(r['m'], e_max, half):.3f} |"
        )
    print(f"fitted to the mm rows: e_max {e_max:.3f}, m_1/2 {half}")
    found = layers(args.gpu)
    print(
        "| layer (h, heads, b; s 2048) | forward ms | backward ms | backward / forward |"
        " plan forward ms | plan backward ms |"
    )
    print("|---|---|---|---|---|---|")
    for r in found:
        print(
            f"| {r['hidden']}, {r['heads']}, {r['micro_batch']} | {r['forward_ms']:.2f} |"
            f" {r['backward_ms']:.2f} | {r['backward_ms'] / r['forward_ms']:.2f} |"
            f" {r['plan_forward_ms']:.2f} | {r['plan_backward_ms']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "profile": gpu.name,
                    "products": rows,
                    "fit": {"e_max": e_max, "half_dim": half},
                    "layers": found,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
