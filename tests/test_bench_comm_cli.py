"""megart-bench's communication benchmarks as a user runs them (tiny sizes: timings are never
asserted, only the shape of the output and that every result was checked)."""

import json
import subprocess
import sys

import pytest

from megart.distributed import find_nccl


def bench(*args):
    return subprocess.run(
        [sys.executable, "-m", "megart.cli.bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("op", ["allreduce", "allgather", "reducescatter", "p2p"])
def test_each_op_prints_nccl_tests_columns_and_writes_json(op, tmp_path):
    out_file = tmp_path / "rows.json"
    out = bench(
        op,
        "--nproc",
        "2",
        "-b",
        "8",
        "-e",
        "4K",
        "-f",
        "8",
        "-n",
        "3",
        "-w",
        "1",
        "--json",
        str(out_file),
    )
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[1].split()
    assert header[:3] == ["size", "(B)", "count"] and "#wrong" in header
    doc = json.loads(out_file.read_text())
    assert doc["op"] == op and doc["backend"] == "shm" and doc["nproc"] == 2
    assert [r["bytes"] for r in doc["rows"]] == [8, 64, 512, 4096]
    for row in doc["rows"]:
        assert set(row) == {"bytes", "count", "dtype", "time_us", "algbw_gbs", "busbw_gbs", "wrong"}
        assert row["wrong"] == 0 and row["time_us"] > 0
    if op == "allreduce":  # nccl-tests' bus factor 2(n-1)/n = 1 for two ranks
        assert all(r["busbw_gbs"] == pytest.approx(r["algbw_gbs"]) for r in doc["rows"])


def test_gloo_baseline_runs_the_same_measurement():
    out = bench("p2p", "--backend", "gloo", "--nproc", "2", "-b", "64", "-e", "64", "-n", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split()[0] == "64"


@pytest.mark.parametrize(
    "args, message",
    [
        (["allreduce", "-b", "1K", "-e", "8"], "need 1 <= -b MIN <= -e MAX"),
        (["p2p", "-b", "lots"], "is not a size like 8, 64K or 16M"),
    ],
)
def test_bad_arguments_exit_nonzero_with_a_message(args, message):
    out = bench(*args)
    assert out.returncode != 0 and message in out.stderr


@pytest.mark.skipif(find_nccl() is not None, reason="NCCL is installed: the benchmark would run")
def test_nccl_backend_without_nccl_says_where_it_looked():
    out = bench("allreduce", "--backend", "nccl", "-b", "8", "-e", "8")
    assert out.returncode != 0
    assert "NCCL was not found" in out.stderr and "libnccl.so.2" in out.stderr


def test_a_run_ends_the_groups_it_started():
    """Under torchrun a torch.distributed group left to the interpreter's shutdown aborted 10 of
    16 finished gloo-baseline runs on a loaded machine ('terminate called without an active
    exception'); run() now ends what it started (0 of 16), and leaves what it did not."""
    import torch.distributed as td

    import megart.distributed as md
    from megart.cli import comm_bench

    cfg = comm_bench.Config("allreduce", max_bytes=64, iters=1, warmup=0, backends=("shm", "gloo"))
    rows = comm_bench.run(cfg)
    assert rows["shm"] and rows["gloo"]
    assert not md.is_initialized() and not td.is_initialized()
    md.init(backend="shm")
    try:
        comm_bench.run(comm_bench.Config("allreduce", max_bytes=64, iters=1, warmup=0))
        assert md.is_initialized()  # the caller's, left as it was
    finally:
        md.destroy()
