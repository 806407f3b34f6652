"""CPU benchmark: an MoE layer's forward and backward with --moe-grouped-gemm (models.moe_grouped:
one grouped product per projection) against the per-expert loop (SequentialMLP's).

Run as ``python bench/moe_grouped_gemm.py``. At each size (experts, hidden size, tokens, dtype)
two layers with the same weights are built, one packed (MoE.group()), and each is warmed up;
then they are timed in turn, round after round, so that drift of the machine (frequency, other
load) hits them alike. Medians over rounds are printed with the grouped layer's time as a ratio
of the loop's (below 1: the flag is faster). fp32 runs the layer in fp32; bf16 under CPU
autocast, as megart train's --bf16. ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

import torch

from megart.models.config import GPTConfig
from megart.models.moe import AuxLossScale, MoE


def make_layers(experts: int, hidden: int, topk: int) -> tuple[MoE, MoE]:
    """The per-expert layer and a packed one with the same weights (SwiGLU, f = 2 h)."""
    cfg = GPTConfig(
        vocab_size=64, seq_length=8, hidden_size=hidden, num_layers=1,
        num_attention_heads=max(1, hidden // 64), num_experts=experts, moe_router_topk=topk,
        moe_ffn_hidden_size=2 * hidden, bias=False, activation="swiglu",
    )  # fmt: skip
    torch.manual_seed(0)
    loop = MoE(cfg, 0, AuxLossScale())
    grouped = MoE(cfg, 0, AuxLossScale())
    grouped.load_state_dict(loop.state_dict())
    grouped.group()
    return loop, grouped


def step(layer: MoE, x: torch.Tensor, bf16: bool) -> None:
    """One forward and backward of ``layer`` on ``x``."""
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = layer(x)
    y.float().square().mean().backward()


def timed(layer: MoE, x: torch.Tensor, bf16: bool, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        step(layer, x, bf16)
    return (time.perf_counter() - start) / repeats


def measure(experts: int, hidden: int, tokens: int, dtype: str, args: argparse.Namespace) -> dict:
    loop, grouped = make_layers(experts, hidden, args.topk)
    x = torch.randn(tokens, 1, hidden, generator=torch.Generator().manual_seed(1))
    bf16 = dtype == "bf16"
    for layer in (loop, grouped):  # warm up each at this size
        timed(layer, x, bf16, args.warmup)
    times: dict[str, list[float]] = {"loop": [], "grouped": []}
    for _ in range(args.rounds):
        times["loop"].append(timed(loop, x, bf16, args.steps))
        times["grouped"].append(timed(grouped, x, bf16, args.steps))
    loop_s, grouped_s = (statistics.median(times[k]) for k in ("loop", "grouped"))
    return dict(experts=experts, hidden=hidden, tokens=tokens, dtype=dtype, loop_ms=loop_s * 1e3,
                grouped_ms=grouped_s * 1e3, ratio=grouped_s / loop_s)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per layer and size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    where = f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}"
    print(f"{where}; {args.experts} experts, top-{args.topk}, SwiGLU f = 2h; forward + backward")
    print(f"{'dtype':>5} {'h':>5} {'tokens':>6} {'loop ms':>9} {'grouped ms':>10} {'ratio':>6}")
    rows = []
    for dtype, hidden, tokens in itertools.product(args.dtypes, args.hidden, args.tokens):
        r = measure(args.experts, hidden, tokens, dtype, args)
        rows.append(r)
        print(f"{dtype:>5} {hidden:>5} {tokens:>6} {r['loop_ms']:>9.2f} {r['grouped_ms']:>10.2f} "
              f"{r['ratio']:>6.2f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), rows=rows), f)


if __name__ == "__main__":
    main()
