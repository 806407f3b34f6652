"""One tensor-parallel MLP layer's forward and backward on CPU ranks (the shm transport), with
the column-parallel entry's backward collective in flight while the weight gradients are
computed (megart.tensor_parallel.column_entry), against the same work in autograd's order (the
weight gradients first, then the collective, waited at once): the baseline, measured in the same
run. Rounds alternate overlapped, baseline, ...; each is the slowest rank's mean over steps; the
medians are reported, after warm-up steps of both. A CPU figure only: on a GPU the collective and
the products run on separate streams, which nothing here measures.

    python bench/tp_backward_overlap.py [--nproc 2] [--hidden 1024] [--tokens 2048] [--sp]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time


def _rank(hidden: int, tokens: int, sp: bool, rounds: int, steps: int) -> dict:
    import torch

    import megart.distributed as dist
    from megart.models.blocks import MLP
    from megart.models.config import GPTConfig
    from megart.tensor_parallel import column_entry
    from megart.tensor_parallel.weight_grad import fusing_accumulation

    dist.init(timeout=600)
    n = dist.get_world_size()
    group = dist.new_group(list(range(n)))
    cfg = GPTConfig(hidden_size=hidden, num_attention_heads=8, num_layers=1)
    mlp = MLP(cfg, 0, group, sp)
    for p in mlp.parameters():
        p.grad = torch.zeros_like(p)  # fused accumulation, as megart train runs it
    rows = tokens // n if sp else tokens
    x = torch.randn(rows, 1, hidden, requires_grad=True)
    overlapped = column_entry._Enter.backward

    def in_order(ctx, grad):  # noqa: ANN001, ANN202
        ctx.slot.run()  # the weight gradients first, as autograd's order had them
        start = column_entry.start_reduce_scatter if ctx.sequence else column_entry.start_all_reduce
        summed, work = start(grad, ctx.group)
        work.wait()
        return summed, None, None, None

    def timed(backward) -> float:  # noqa: ANN001
        column_entry._Enter.backward = staticmethod(backward)
        dist.barrier(group=group)
        start = time.perf_counter()
        with fusing_accumulation():
            for _ in range(steps):
                mlp(x).sum().backward()
        mean = (time.perf_counter() - start) / steps
        slowest = torch.tensor([mean], dtype=torch.float64)
        dist.all_reduce(slowest, op="max", group=group)
        return float(slowest)

    timed(overlapped)  # warm-up of both
    timed(in_order)
    times: dict[str, list[float]] = {"overlapped": [], "in_order": []}
    for _ in range(rounds):
        times["overlapped"].append(timed(overlapped))
        times["in_order"].append(timed(in_order))
    column_entry._Enter.backward = staticmethod(overlapped)
    dist.destroy()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    from megart.launcher import launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    got = launch(
        _rank, args.nproc, args.hidden, args.tokens, args.sp, args.rounds, args.steps, timeout=3600
    )[0]
    print(
        f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} cores, {args.nproc} "
        f"ranks, hidden {args.hidden}, {args.tokens} tokens, sp={args.sp}, fp32, medians of "
        f"{args.rounds} alternating rounds of {args.steps} steps"
    )
    ratio = got["in_order"] / got["overlapped"]
    print(
        f"overlapped {1e3 * got['overlapped']:.1f} ms, in autograd's order "
        f"{1e3 * got['in_order']:.1f} ms: {ratio:.3f}x"
    )


if __name__ == "__main__":
    main()
