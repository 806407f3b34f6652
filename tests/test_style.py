"""The Python is ruff-clean (lint and format) and the C++ clang-format-clean, so style is
checked in the same test command."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff(args):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is a test dependency: pip install 'megart[test]'")
    out = subprocess.run(
        [ruff, *args, "python", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_clang_format():
    clang_format = shutil.which("clang-format")
    if clang_format is None:
        pytest.fail("clang-format is a test dependency: pip install 'megart[test]'")
    sources = [
        p
        for folder in ("cpp", "cuda", "tests/standin")
        for p in sorted((ROOT / folder).rglob("*"))
        if p.suffix in {".cpp", ".hpp", ".h", ".cu", ".cuh"}
    ]
    assert sources, "no C++ sources found"
    out = subprocess.run(
        [clang_format, "--dry-run", "--Werror", *map(str, sources)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, "clang-format -i the files named:\n" + out.stderr[-4000:]
