"""megart imports and describes itself without a GPU, a driver or NCCL."""

import os
import subprocess
import sys

import pytest

import megart
from megart import MegartError
from megart.distributed import nccl


def test_build_info_has_the_promised_keys():
    info = megart.build_info()
    for key in ("version", "cuda_compiled", "cuda_version", "gpu_available", "nccl_version"):
        assert key in info
    assert info["version"] == megart.__version__
    assert isinstance(info["cuda_compiled"], bool)
    assert (info["cuda_version"] is not None) == info["cuda_compiled"]
    assert info["gpu_available"] == (info["gpu_count"] > 0)


def test_import_needs_neither_gpu_nor_nccl_and_does_not_load_torch():
    # A clean interpreter that hides every GPU and points NCCL nowhere.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MEGART_NCCL_LIBRARY": "/nonexistent.so"}
    code = "import sys, megart; print('torch' in sys.modules); megart.build_info()"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # importing megart does not import torch


def test_missing_nccl_error_lists_where_it_looked(monkeypatch):
    monkeypatch.setenv("MEGART_NCCL_LIBRARY", "/nowhere/libnccl.so.2")
    monkeypatch.setattr(nccl, "_site_dirs", lambda: [])
    monkeypatch.setattr(nccl, "_SONAME", "libnccl-megart-test-absent.so.2")
    with pytest.raises(MegartError) as e:
        nccl.load_nccl()
    assert "/nowhere/libnccl.so.2" in str(e.value)
    assert "MEGART_NCCL_LIBRARY" in str(e.value)


def test_nccl_candidates_start_with_the_explicit_path(monkeypatch):
    monkeypatch.setenv("MEGART_NCCL_LIBRARY", "/opt/custom/libnccl.so.2")
    assert nccl.nccl_candidates()[0] == "/opt/custom/libnccl.so.2"
    assert nccl.nccl_candidates()[-1] == "libnccl.so.2"
