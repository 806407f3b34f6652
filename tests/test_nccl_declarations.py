"""megart's declarations of NCCL's C API (cuda/comm) compiled against nccl.h: the documented
stand-in (tests/nccl_abi/documented) and, where an nvidia-nccl wheel or the system has one, the
installed header; and, where NCCL is installed, every symbol megart looks up and its unique ids
(no GPU needed)."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megart.distributed import find_nccl

needs_cuda_module = pytest.mark.skipif(
    importlib.util.find_spec("megart._cuda") is None, reason="megart built without CUDA"
)

ROOT = Path(__file__).resolve().parents[1]


def _cuda_include():
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parents[1]))
    for home in filter(None, homes):
        if (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    return None


def _installed_nccl_h():
    """nccl.h of the NCCL megart would load (an nvidia-nccl wheel ships it beside the library),
    MEGART_NCCL_INCLUDE, or the system's."""
    places = [os.environ.get("MEGART_NCCL_INCLUDE"), "/usr/include"]
    found = find_nccl()
    if found is not None:
        places.insert(0, str(Path(found[0]).resolve().parents[1] / "include"))
    for place in filter(None, places):
        if (Path(place) / "nccl.h").is_file():
            return Path(place)
    return None


def _check_abi(nccl_include):
    compiler = shutil.which("c++") or shutil.which("g++")
    cuda_include = _cuda_include()
    if compiler is None or cuda_include is None:
        pytest.skip("needs a C++ compiler and the CUDA toolkit's headers")
    cmd = [compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", f"-I{nccl_include}"]
    cmd += [f"-I{ROOT / 'cuda'}", f"-I{ROOT / 'cpp'}", f"-I{cuda_include}"]
    done = subprocess.run(
        [*cmd, str(ROOT / "tests" / "nccl_abi" / "check.cpp")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_nccl_declarations_match_the_documented_api():
    _check_abi(ROOT / "tests" / "nccl_abi" / "documented")


def test_nccl_declarations_match_the_installed_nccl_h():
    include = _installed_nccl_h()  # looked for here, not at collection: that loads NCCL
    if include is None:
        pytest.skip("no nccl.h here (an nvidia-nccl-cu12 wheel has one)")
    _check_abi(include)


@needs_cuda_module
def test_the_found_nccl_has_every_function_megart_calls():
    """Needs NCCL but no GPU: every symbol megart looks up resolves, and unique ids come out."""
    from megart import _cuda

    if find_nccl() is None:
        pytest.skip("no NCCL here")
    path, version = find_nccl()
    features = _cuda.nccl_features(path)
    assert features["version"] == version
    major, minor = (int(x) for x in version.split(".")[:2])
    assert features["nonblocking"] == ((major, minor) >= (2, 14))
    assert features["last_error"] == ((major, minor) >= (2, 13))
    first, second = _cuda.nccl_unique_id(path), _cuda.nccl_unique_id(path)
    assert len(first) == len(second) == 128 and first != second
