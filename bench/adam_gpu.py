"""GPU benchmark: megart's CUDA AdamW against torch.optim.AdamW(fused=True), and the ceiling.

Run as ``python bench/adam_gpu.py`` on a CUDA machine. The ceiling is a measured device-to-device
copy (bytes read + written per second). An fp32 AdamW step must read the parameter, gradient and
two moments and write the parameter and two moments: 28 bytes per parameter, so its bandwidth is
28 x params / time, reported beside the copy's. The two optimizers own separate parameters and
states and share the gradients; they take turns round after round (CUDA events, medians). Before
timing, one step of each on the same data is compared. Without CUDA it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import megart.optim
from adam import make_sizes  # bench/adam.py, beside this file
from kernels import time_ms  # bench/kernels.py: CUDA-event timing


def copy_ceiling_gbs(nbytes: int, rounds: int) -> float:
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = statistics.median(time_ms(lambda: dst.copy_(src), 5) for _ in range(rounds))
    return 2 * nbytes / (ms / 1e3) / 1e9


def check_agreement(sizes: list[int]) -> float:
    """One step of each optimizer on the same small data; the largest relative difference."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    grads = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    out = []
    for make in (
        lambda p: megart.optim.AdamW(p, lr=1e-3, weight_decay=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=1e-2, fused=True),
    ):
        params = [b.clone().requires_grad_(True) for b in base]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt = make(params)
        for _ in range(3):
            opt.step()
        out.append(torch.cat([p.detach() for p in params]))
    return float(((out[0] - out[1]).norm() / out[1].norm()).item())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000_000)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("adam_gpu: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    rel = check_agreement([1, 7, 4097, 1 << 20])
    print(f"agreement after 3 steps: ||megart - torch fused|| / ||torch fused|| = {rel:.2e}")
    if not rel < 1e-5:
        print("adam_gpu: megart and torch disagree; not timing", file=sys.stderr)
        return 1
    ceiling = copy_ceiling_gbs(4 << 30, args.rounds)

    sizes = make_sizes(args.params, args.tensors)
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name in ("megart", "torch fused"):
        params = [torch.randn(n, device="cuda", generator=gen).requires_grad_() for n in sizes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        kwargs = dict(lr=1e-3, weight_decay=1e-2)
        optimizers[name] = (
            megart.optim.AdamW(params, **kwargs)
            if name == "megart"
            else torch.optim.AdamW(params, fused=True, **kwargs)
        )
    for opt in optimizers.values():  # state allocated, kernels loaded
        opt.step()
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(args.rounds):
        for name, opt in optimizers.items():
            times[name].append(time_ms(opt.step, args.steps))

    medians = {name: statistics.median(t) for name, t in times.items()}
    moved = 28 * args.params
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: AdamW step, "
        f"{args.params / 1e9:.2f}B fp32 params in {args.tensors} tensors"
    )
    print(f"device-to-device copy: {ceiling:.0f} GB/s (read + write)")
    print(f"{'optimizer':<13}{'median ms':>10}{'GB/s':>8}{'of copy':>9}{'vs megart':>11}")
    for name, ms in medians.items():
        gbs = moved / (ms / 1e3) / 1e9
        print(
            f"{name:<13}{ms:>10.2f}{gbs:>8.0f}{gbs / ceiling:>9.1%}{ms / medians['megart']:>10.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "params": args.params,
                    "tensors": args.tensors,
                    "copy_gbs": ceiling,
                    "agreement_rel": rel,
                    "median_ms": medians,
                    "all_ms": times,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
