"""GPU memory reporting (megart.training.memory_report) and bench/plan_vs_run.py. The CUDA
counters cannot be read on CPU, so the line, the printing rule and the table are checked with
given numbers, and a real CPU run is checked to print and log no memory at all."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megart.training.memory_report import MB, MemoryLines, memory_line

BENCH = Path(__file__).resolve().parents[1] / "bench" / "plan_vs_run.py"
MODEL = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 2"
).split()
FIG = {
    "iteration": 2,
    "mem_allocated_bytes": 1234.5 * MB,
    "mem_max_allocated_bytes": 4096 * MB,
    "mem_reserved_bytes": 5000.25 * MB,
    "mem_max_reserved_bytes": 6000 * MB,
    "mem_allocated_count": 77,
    "mem_static_bytes": 1200 * MB,
}
# How log parsers read Megatron-LM's report_memory line.
MEGATRON = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
    r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)"
)


def test_the_line_is_megatrons_with_the_static_figure_last():
    line = memory_line(3, FIG)
    assert line == (
        "[Rank 3] (after 2 iterations) memory (MB) | allocated: 1234.50 | max allocated: "
        "4096.00 | reserved: 5000.25 | max reserved: 6000.00 | static: 1200.00"
    )
    assert MEGATRON.match(line).groups() == ("3", "2", "1234.50", "4096.00", "5000.25", "6000.00")


@pytest.mark.parametrize(
    ("start", "interval", "printed"),
    [(0, 1, [1, 2]), (0, 5, [1, 5]), (10, 1, [11, 12]), (10, 5, [15])],
)
def test_lines_at_logged_iterations_until_one_past_the_second(start, interval, printed):
    memory = MemoryLines(True, 0, start)
    said = []
    for it in range(start + 1, start + 21):
        logged = it % interval == 0 or it == 1
        if memory.line({**FIG, "iteration": it}, logged) is not None:
            said.append(it)
    assert said == printed
    assert MemoryLines(False, 0, 0).line(FIG, True) is None  # not data-parallel rank 0
    assert MemoryLines(True, 0, 0).line({"iteration": 1}, True) is None  # no CUDA figures


def test_plan_vs_run_table_with_memory(tmp_path):
    sys.path.insert(0, str(BENCH.parent))
    try:
        import plan_vs_run
    finally:
        sys.path.remove(str(BENCH.parent))
    log = tmp_path / "run.jsonl"
    records = [{**FIG, "iteration": i, "time_s": t} for i, t in ((1, 9.0), (2, 9.0), (3, 2.0))]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = plan_vs_run.measured(str(log))
    assert run["iteration_time_s"] == 2.0  # the warm-up iterations left out
    plan = {
        "num_gpus": 8,
        "gpu": "h100-80gb",
        "layout": {"flags": "--tensor-model-parallel-size 8"},
        "iteration_time_s": 1.0,
        "memory_gib": {"parameters": 0.5, "gradients": 0.25, "optimizer": 0.25, "total": 2.0},
    }
    text = plan_vs_run.table(plan, run)
    assert "| iteration time (s) | 1 | 2 | 2.00 |" in text
    assert "| params + grads + optimizer vs static (GiB) | 1 | 1.172 | 1.17 |" in text
    assert "| total vs max allocated (GiB) | 2 | 4 | 2.00 |" in text


def test_a_cpu_run_reports_no_memory_and_plan_vs_run_gives_its_time(tmp_path):
    log = tmp_path / "run.jsonl"
    train = subprocess.run(
        [sys.executable, "-m", "megart", "train", *MODEL, "--eval-iters", "0", "--train-iters",
         "3", "--log-jsonl", str(log), "--tensorboard-dir", str(tmp_path / "tb"),
         "--log-memory-to-tensorboard"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr
    assert "memory (MB)" not in train.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 3
    assert not [k for r in records for k in r if k.startswith("mem_")]
    bench = subprocess.run(
        [sys.executable, str(BENCH), "--log-jsonl", str(log), "--gpu", "h100-80gb",
         "--num-gpus", "1", *MODEL, "--tensor-model-parallel-size", "1",
         "--pipeline-model-parallel-size", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    rows = [line for line in bench.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows] == ["| figure", "| iteration time (s)"]
    assert "no memory figures in the log" in bench.stdout
