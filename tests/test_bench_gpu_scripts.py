"""The CPU-checkable parts of the GPU benchmarks that measure `megart plan`'s cost model
(bench/gemm_sweep.py, bench/layer_profile.py): the efficiency fit, the kernel classification
on names an H200 run printed, and the clear exit without a GPU; and bench/grad_accum_fusion.py
run small on a CPU."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(BENCH))  # layer_profile imports gemm_sweep, as when run from bench/
    try:
        yield importlib.import_module("gemm_sweep"), importlib.import_module("layer_profile")
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("e_max,half", [(0.8, 228), (0.6, 64)])
def test_the_fit_recovers_the_constants_of_rows_that_follow_the_form(scripts, e_max, half):
    sweep, _ = scripts
    rows = [
        {"kind": "mm, rows = m", "m": m, "eff": sweep.model_eff(m, e_max, half)}
        for m in sweep.SMALL
    ]
    rows.append({"kind": "bmm scores", "m": 64, "eff": 0.9})  # not a dense row: ignored
    got_e, got_half = sweep.fit(rows)
    assert got_half == half and got_e == pytest.approx(e_max)


# Kernel names (shortened) from the third H200 session's profiles (bench/RESULTS.md), and one
# of FlashAttention-2's own.
KERNELS = [
    ("flash backward", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26"),
    ("flash backward", "void cudnn::fusion::compute_dot_do_o_specialized<true, 128>"),
    ("flash backward", "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)"),
    ("flash backward", "void flash_bwd_dq_dk_dv_loop_kernel<Flash_bwd_kernel_traits<cutlass"),
    ("flash forward", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7"),
    ("matrix products", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT"),
    ("activation", "at::native::vectorized_elementwise_kernel<8, GeluBackwardCUDAKernelImpl"),
    ("norms", "at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate"),
    ("norms", "at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized"),
    ("copies", "at::native::elementwise_kernel<128, 4, gpu_kernel_impl_nocast<direct_copy_kernel"),
    ("other element-wise", "at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>"),
]


@pytest.mark.parametrize("kind,name", KERNELS)
def test_kernels_are_sorted_by_what_they_compute(scripts, kind, name):
    _, profile = scripts
    assert profile.kind_of(name) == kind


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_without_a_gpu_both_exit_with_status_2_and_say_why(scripts, capsys):
    sweep, profile = scripts
    assert sweep.main([]) == 2
    assert profile.main([]) == 2
    assert capsys.readouterr().err.count("no CUDA GPU") == 2


@pytest.mark.parametrize(
    "compare, modes",
    [
        ("fusion", ("fused", "unfused")),
        ("residual", ("16-bit", "fp32")),
        ("weights", ("fp32", "16-bit")),
    ],
)
def test_grad_accum_fusion_bench_times_both_modes_on_the_same_model(tmp_path, compare, modes):
    # bench/grad_accum_fusion.py on a CPU, tiny: both trainers train the same GPT on the same
    # data, so after the same iterations their losses agree to bf16's rounding.
    import json
    import subprocess

    out = tmp_path / "gaf.json"
    tiny = "--layers 1 --hidden 64 --heads 2 --seq 32 --micro-batch 1 --microbatches 2"
    done = subprocess.run(
        [sys.executable, str(BENCH / "grad_accum_fusion.py"), *tiny.split(), "--rounds", "1"]
        + ["--iters", "1", "--compare", compare, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{modes[1]} / {modes[0]}:" in done.stdout
    r = json.loads(out.read_text())
    assert set(r["times_s"]) == set(modes)
    assert all(len(t) == 1 and t[0] > 0 for t in r["times_s"].values())
    assert r["last_loss"][modes[0]] == pytest.approx(r["last_loss"][modes[1]], rel=1e-2)
