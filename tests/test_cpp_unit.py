"""Builds the C++ core on its own (no Python, no torch) and runs its unit tests, so that they run
inside the same test command as the Python suite."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cpp_tests(tmp_path_factory):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is needed for the C++ unit tests: pip install 'megart[test]'")
    build = tmp_path_factory.mktemp("cpp-build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (
        [cmake, "-S", str(ROOT / "cpp"), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Debug"],
        [cmake, "--build", str(build), "--parallel", "2"],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return build / "megart_cpp_tests"


def test_cpp_unit_tests_pass(cpp_tests):
    done = subprocess.run([str(cpp_tests)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 failed" in done.stdout
