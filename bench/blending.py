"""CPU benchmark: the blending order of ``--data-order megatron`` (which dataset each sample of
a BlendedDataset comes from), megart's C++ core against Megatron-Core's compiled helper.

Run as ``python bench/blending.py``. For each blend size and dataset count, both build the
indices for the same float64 weights; their outputs are compared first (a difference stops the
run), then they are timed in turn, round after round, after a warm-up at that size, so that
drift of the machine hits them alike. Each timed call includes what a real build pays: the two
output arrays' allocation (megart's binding allocates them; Megatron-Core's BlendedDataset
allocates them with numpy.zeros before calling its helper, as here). Medians are reported with
the ratio Megatron-Core / megart. megart has no Python or numpy fallback for this order (the
rule is sequential, each choice depending on the counts so far), so there is no third column.
``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import numpy as np

from megart import _core

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers_cpp


def megart_order(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    # What megatron_blend.blending_indices calls, without its list conversion of the weights.
    return _core.data.blending_indices(weights.tolist(), size)


def megatron_order(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    # As BlendedDataset._build_indices: zeroed arrays, then the helper fills them.
    which = np.zeros(size, dtype=np.int16)
    nth = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(which, nth, weights, len(weights), size, False)
    return which, nth


BUILDERS: dict[str, Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]] = {
    "megart": megart_order,
    "megatron-core": megatron_order,
}


def blend_weights(n: int) -> np.ndarray:
    """Uneven weights (between 0.5 and 1.5 before normalisation), seeded by ``n``."""
    w = np.random.default_rng(n).uniform(0.5, 1.5, n)
    return w / np.sum(w)


def timed(build: Callable[[], object]) -> float:
    start = time.perf_counter()
    out = build()
    elapsed = time.perf_counter() - start
    del out  # freed outside the timed region
    return elapsed


def measure(size: int, n: int, rounds: int) -> dict:
    weights = blend_weights(n)
    # Equal outputs first (this is also each builder's warm-up at this size).
    first = {name: build(weights, size) for name, build in BUILDERS.items()}
    ours, theirs = first["megart"], first["megatron-core"]
    if not (np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])):
        raise SystemExit(f"outputs differ at size {size}, {n} datasets")
    del first, ours, theirs
    times: dict[str, list[float]] = {name: [] for name in BUILDERS}
    for _ in range(rounds):
        for name, build in BUILDERS.items():
            times[name].append(timed(lambda b=build: b(weights, size)))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "size": size,
        "datasets": n,
        "rounds": rounds,
        "seconds": times,
        "median_s": medians,
        "megatron_over_megart": medians["megatron-core"] / medians["megart"],
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000, 100_000_000]
    )
    parser.add_argument("--datasets", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds below 1e8 samples")
    parser.add_argument("--big-rounds", type=int, default=3, help="timed rounds from 1e8 samples")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()

    rows = []
    for size in args.sizes:
        for n in args.datasets:
            rounds = args.big_rounds if size >= 100_000_000 else args.rounds
            rows.append(measure(size, n, rounds))
    print(f"Blending order, {cpu_name()}; outputs equal in all")
    print("s: median (fastest-slowest) over the rounds")
    print(
        "| samples | datasets | rounds | megart (s) | Megatron-Core (s) | Megatron-Core / megart |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [
            f"{r['median_s'][name]:.4f} ({min(t):.4f}-{max(t):.4f})"
            for name, t in r["seconds"].items()
        ]
        print(
            f"| {r['size']:,} | {r['datasets']} | {r['rounds']} | {cells[0]} | {cells[1]} "
            f"| {r['megatron_over_megart']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
