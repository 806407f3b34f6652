"""The built ``megart._cuda`` module's machine code (SASS), read with cuobjdump: every hot kernel,
for every architecture it was built for, moves global memory in 128-bit loads and stores and
never touches local memory (no register spills). No GPU needed: this checks what the compiler
produced, not how fast it runs (that is unverified without a GPU)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import megart
from cuda_sass import disassemble, find_tool, problems, resource_usage

cuda_built = megart.build_info()["cuda_compiled"]
pytestmark = pytest.mark.skipif(not cuda_built, reason="built without a CUDA toolkit")

ARCHS = {"sm_80", "sm_90"}  # CMakeLists' CUDA architectures
# Hot kernels by the name in their mangled symbol: (needs 128-bit loads, needs 128-bit stores).
# The cross-entropy forward writes three floats per row, so only its loads are wide.
HOT = {
    "adam_kernel": (True, True),
    "scale_kernel": (True, True),
    "bias_gelu_forward_kernel": (True, True),
    "bias_gelu_backward_kernel": (True, True),
    "add_layer_norm_forward_kernel": (True, True),
    "add_layer_norm_backward_kernel": (True, True),
    "cross_entropy_forward_kernel": (True, False),
    "cross_entropy_backward_kernel": (True, True),
    # Sums a [blocks, hidden] fp32 buffer by columns: a warp's 32-bit loads are one 128-byte
    # line, so only the no-spill bar applies.
    "column_sum_kernel": (False, False),
}


def hot_name(mangled: str) -> str | None:
    # Itanium mangling spells a name as <length><name>: match the whole identifier.
    for name in HOT:
        if f"{len(name)}{name}" in mangled:
            return name
    return None


@pytest.fixture(scope="module")
def module_path() -> Path:
    from megart import _cuda

    if find_tool("cuobjdump") is None or find_tool("nvdisasm") is None:
        pytest.fail("cuobjdump/nvdisasm not found: `pip install .[test]` installs them")
    return Path(_cuda.__file__)


@pytest.fixture(scope="module")
def kernels(module_path):
    return disassemble(module_path)


def test_every_hot_kernel_is_built_for_every_architecture(kernels):
    seen = {(k.arch, hot_name(k.mangled)) for k in kernels if hot_name(k.mangled)}
    missing = {(a, n) for a in ARCHS for n in HOT} - seen
    assert not missing, f"kernels missing from the module's SASS: {sorted(missing)}"


def test_hot_kernels_move_128_bits_and_do_not_spill(kernels):
    bad = []
    for k in kernels:
        name = hot_name(k.mangled)
        if name is None:
            continue
        loads, stores = HOT[name]
        for problem in problems(k, loads, stores):
            bad.append(f"{k.arch} {k.mangled}: {problem}")
    assert not bad, "\n".join(bad)


def test_ptxas_resources_show_no_stack_or_local_memory(module_path):
    # What `nvcc -Xptxas -v` reports at build time, read back from the binary.
    usage = resource_usage(module_path)
    hot = {key: u for key, u in usage.items() if hot_name(key[1])}
    assert hot, "no resource usage read for the hot kernels"
    bad = [f"{a} {n}: {u}" for (a, n), u in hot.items() if u.get("LOCAL") or u.get("STACK")]
    assert not bad, "\n".join(bad)


# Three small kernels compiled here, so the checker is shown to reject what it must: a scalar
# copy (32-bit loads and stores), a 128-bit load with four 32-bit stores (what megart's LayerNorm
# kernels compiled to before), and a local array indexed at run time (local memory).
PROBE = r"""
struct alignas(16) Four { float v[4]; };
extern "C" __global__ void wide(const float4* in, float4* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = in[i];
}
extern "C" __global__ void scalar(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = in[i] * 2.0f;
}
extern "C" __global__ void split_store(const float4* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float4 x = in[i];
    out[4 * i] = x.x; out[4 * i + 1] = x.y; out[4 * i + 2] = x.z; out[4 * i + 3] = x.w;
  }
}
extern "C" __global__ void spills(const float4* in, float4* out, const int* pick, int n) {
  float4 local[64];
  for (int k = 0; k < 64; ++k) local[k] = in[k * n + threadIdx.x];
  out[threadIdx.x] = local[pick[threadIdx.x] & 63];
}
"""


def test_the_checker_rejects_scalar_split_and_spilling_kernels(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    (tmp_path / "probe.cu").write_text(PROBE)
    cubin = tmp_path / "probe.cubin"
    subprocess.run(
        [nvcc, "-cubin", "-arch=sm_80", "-O3", "-o", str(cubin), str(tmp_path / "probe.cu")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    found = {k.mangled: problems(k) for k in disassemble(cubin)}
    assert found["wide"] == []
    assert found["scalar"] == [
        "no 128-bit global load (LDG.E.128)",
        "no 128-bit global store (STG.E.128)",
    ]
    assert found["split_store"] == ["no 128-bit global store (STG.E.128)"]
    assert any("local-memory" in p for p in found["spills"]), found["spills"]
    usage = {name: u for (_, name), u in resource_usage(cubin).items()}
    assert usage["spills"]["STACK"] > 0 and usage["wide"]["STACK"] == 0
