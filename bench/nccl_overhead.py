"""GPU benchmark: megart's nccl transport against torch.distributed's NCCL process group, one rank.

Run as ``python bench/nccl_overhead.py`` on a machine with one GPU (NCCL refuses two ranks on one
GPU, so both worlds have one rank). For each op (8-byte all_reduce; a self send + receive) the
two libraries take turns, round after round, and the medians are compared:

- ``enqueue``: N ops back to back, then one device synchronize; time / N. This is what a
  training step sees: the host's cost per op while the GPU runs behind it.
- ``latency``: one op, then a device synchronize; the round trip of a single small op.

Every op's result is checked once before timing. Without CUDA it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch


def _torch_world() -> object:
    import torch.distributed as td

    td.init_process_group("nccl", store=td.HashStore(), rank=0, world_size=1)
    return td


def _megart_world() -> object:
    import megart.distributed as md

    md.init(backend="nccl")
    return md


def _all_reduce(d: object, t: torch.Tensor) -> Callable[[], None]:
    return lambda: d.all_reduce(t)


def _self_p2p(d: object, a: torch.Tensor, b: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        works = d.batch_isend_irecv([d.P2POp(d.isend, a, 0), d.P2POp(d.irecv, b, 0)])
        for w in works:
            w.wait()

    return run


def _checked_cases(libs: dict[str, object]) -> dict[str, dict[str, Callable[[], None]]]:
    """Each library's ops on fresh data, checked once; an op either library refuses (torch may
    refuse a send to its own rank) is dropped for both, with a note."""
    cases: dict[str, dict[str, Callable[[], None]]] = {name: {} for name in libs}
    for op in ("all_reduce 8B", "self p2p 8B"):
        made = {}
        for name, d in libs.items():
            a = torch.arange(2, dtype=torch.float32, device="cuda") + 1  # 8 bytes
            b = torch.zeros(2, device="cuda")
            run = _all_reduce(d, a) if op.startswith("all_reduce") else _self_p2p(d, a, b)
            try:
                run()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported, and the op is left out
                print(f"note: {name} refused {op} ({type(e).__name__}: {e}); op skipped")
                break
            got = (a if op.startswith("all_reduce") else b).tolist()
            if got != [1.0, 2.0]:
                raise SystemExit(f"{name}: {op} gave {got}, expected [1.0, 2.0]")
            made[name] = run
        if len(made) == len(libs):
            for name, run in made.items():
                cases[name][op] = run
    return cases


def _time(run: Callable[[], None], n: int, sync_each: bool) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000, help="ops per timed round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("nccl_overhead: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    libs = {"megart": _megart_world(), "torch": _torch_world()}
    cases = _checked_cases(libs)
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rounds} rounds")
    print(f"{'op':<16}{'mode':<10}{'megart us':>11}{'torch us':>11}{'megart/torch':>14}")
    for op in cases["megart"]:
        for mode, sync_each in (("enqueue", False), ("latency", True)):
            n = args.iters if not sync_each else max(1, args.iters // 10)
            times: dict[str, list[float]] = {name: [] for name in libs}
            for name in libs:  # warm-up
                _time(cases[name][op], n, sync_each)
            for _ in range(args.rounds):
                for name in libs:
                    times[name].append(_time(cases[name][op], n, sync_each))
            med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
            results.setdefault(op, {})[mode] = med
            ratio = med["megart"] / med["torch"]
            print(f"{op:<16}{mode:<10}{med['megart']:>11.2f}{med['torch']:>11.2f}{ratio:>14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "median_us": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
