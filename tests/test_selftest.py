"""megart selftest: passes on this CPU machine with its GPU checks skipped (with the reason);
its GPU checks' logic, run here on CPU tensors, fails a wrong kernel or transport and names the
flag that avoids it (the mixture-of-experts check's: tests/test_selftest_moe.py); under
torchrun it compares every collective with torch.distributed's."""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch

import selftest_workers as sw
from megart.launcher import launch
from megart.selftest import components, report, training

GPU_CHECKS = {
    "NCCL",
    "nccl one-rank collectives",
    "kernels (CUDA), every dtype",
    "ring attention flash blocks (CUDA)",
    "ring attention windowed blocks (CUDA)",
    "sliding window (CUDA)",
    "mixture of experts (CUDA)",
    "AdamW (CUDA) vs torch fused",
    "training on GPU vs CPU",
    "collectives under torchrun vs torch NCCL",
}


def test_python_m_megart_selftest_passes_on_cpu_and_skips_the_gpu_checks(tmp_path):
    out = tmp_path / "selftest.json"
    run = subprocess.run(
        [sys.executable, "-m", "megart", "selftest", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    checks = json.loads(out.read_text())["checks"]
    by_name = {c["name"]: c for c in checks}
    assert {c["status"] for c in checks} == {"pass", "skip"}
    for name in GPU_CHECKS:
        assert by_name[name]["status"] == "skip" and "no GPU" in by_name[name]["detail"]
    cpu = {c["name"] for c in checks if c["status"] == "pass"}
    assert {"core: 1f1b schedule simulator", "AdamW (C++ multi-tensor)"} <= cpu
    assert "training tp2 (shm, 2 ranks)" in cpu
    assert {"sliding window query tiles float32", "sliding window one s x s mask float32"} <= cpu
    assert "ring attention windowed blocks float32" in cpu
    assert {"moe top-2 softmax float32", "moe swiglu top-2 bfloat16"} <= cpu
    assert sum(name.startswith("moe ") for name in cpu) == 10  # 5 layers x fp32, bf16
    # The shm transport: every op at fp32 and bf16, with its error and time against gloo.
    shm = [c for c in checks if c["name"].startswith("shm ")]
    assert len(shm) == 18 and all(c["error"] == 0 and c["time_ratio"] > 0 for c in shm)
    header = run.stdout.splitlines()[0].split()
    assert header[:2] == ["component", "result"] and "passed," in run.stdout


def test_torchrun_megart_selftest_compares_every_op_with_torch(tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
    run = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "-m", "megart", "selftest", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    checks = json.loads(run.stdout)["checks"]  # printed once, by rank 0
    assert len(checks) == 27 + 2 + 3  # 9 ops x fp32, bf16, fp16; two schedules; three layouts
    assert all(c["status"] == "pass" for c in checks), checks
    assert all(c["name"].startswith("shm 2 ranks") for c in checks[:27])
    # A second init under torchrun's store, and ranks launched from a torchrun worker (the
    # one-process reference): both hung before their fixes.
    assert [c["name"] for c in checks[27:]] == [
        *(f"training tp1 pp2 {kind} (shm, 2 ranks)" for kind in ("interleaved", "zb-v")),
        "training cp2 all-gather tp1 (shm, 2 ranks)",
        "training cp2 ring tp1 (shm, 2 ranks)",
        "training llama-style tp2 sp qk-layernorm (shm, 2 ranks)",
    ]


def test_a_wrong_transport_fails_its_ops_and_names_the_fallback():
    checks = launch(sw.compare_with_a_broken_all_reduce, 2, timeout=120)
    assert checks[0] == checks[1]  # the same verdicts on every rank
    failed = {name for name, status, _ in checks[0] if status == "fail"}
    assert failed == {f"shm all_reduce {op} float32" for op in ("sum", "avg", "max")}
    assert all(avoid == "--distributed-backend torch" for _, s, avoid in checks[0] if s == "fail")


def test_kernel_checks_pass_the_reference_and_fail_a_wrong_kernel_naming_its_flag():
    checks = components.check_kernels(torch.device("cpu"))
    assert len(checks) == 9 and all(c.status == "pass" for c in checks), checks
    off = dataclasses.replace(
        components.KERNELS[0],
        run=lambda x, b: components.KERNELS[0].run(x, b) * 1.1,  # 10% off, as a broken kernel
    )
    bad = components.check_kernels(torch.device("cpu"), (off,), (torch.float32, torch.bfloat16))
    assert [c.status for c in bad] == ["fail", "fail"]
    # bias-GeLU fusion is on by default in megart train: the flag that turns it off.
    assert all("avoid it with --no-bias-gelu-fusion" in c.detail for c in bad)
    assert all(c.avoid == "--no-bias-gelu-fusion" and c.error > 5e-3 for c in bad)
    assert components.KERNELS[1].avoid() == "no --fused-layer-norm (it is off by default)"
    nan = components.Kernel("nan", off.make, lambda x, b: x * float("nan"), off.reference, "--x")
    assert components.check_kernels(torch.device("cpu"), (nan,), (torch.float32,))[
        0
    ].error == float("inf")


def test_adamw_check_and_curve_comparison_judge_by_their_tolerance():
    (adamw,) = components.check_adamw(torch.device("cpu"))
    assert adamw.status == "pass" and adamw.error < 1e-6
    want = [{"iteration": i, "loss": 5.0 - i, "grad_norm": 1.0} for i in (1, 2)]
    close = [{**h, "loss": h["loss"] * (1 + 1e-4)} for h in want]
    assert training.compare_curves("c", close, want, 1e-3, None).status == "pass"
    assert training.compare_curves("c", close, want, 1e-5, "--x").avoid == "--x"
    assert training.compare_curves("c", want[:1], want, 1e-3, None).status == "fail"


def test_report_exit_status_table_and_json():
    checks = [
        report.Check("a", "pass", "fine", 0.0, 0.5),
        report.skip("b", "no GPU: none"),
        report.judged("c", 1.0, 1e-3, None, "--distributed-backend torch"),
    ]
    assert report.exit_status(checks) == 1 and report.exit_status(checks[:2]) == 0
    assert "--distributed-backend torch" in report.summary(checks)
    lines = report.table(checks).splitlines()
    assert lines[0].split()[:2] == ["component", "result"] and "FAIL" in lines[-1]
    doc = json.loads(report.to_json(checks))
    assert [c["status"] for c in doc["checks"]] == ["pass", "skip", "fail"]
    assert {"name", "status", "detail"} <= doc["checks"][0].keys()
    assert report.guarded("x", lambda: 1 / 0, "--y")[0].detail.startswith("ZeroDivisionError")
