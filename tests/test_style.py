"""The Python is ruff-clean (lint and format), so style is checked in the same test command."""

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
