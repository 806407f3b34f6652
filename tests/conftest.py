"""Shared test settings: hypothesis profiles sized for 2-core CI machines, and Megatron-Core
imported once by the launcher's fork server rather than by every rank that compares with it."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import megart.launcher

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# About fifty launches compare with Megatron-Core (tests/megatron*_workers.py and others), and
# each of their ranks imported megatron.core on its own: some 2 s of CPU a rank, 5 to 7 s of a
# 4-rank launch on 2 cores. The launcher's fork server imports its preload list once, when the
# session's first launch starts it, and forks every rank from it (megart.launcher._PRELOAD); adding
# megatron.core there has each rank start with it already imported. Nothing in megart imports
# megatron (the pytest process itself imports it while collecting), the import starts no
# threads, and a missing megatron-core is skipped by the fork server (it ignores ImportError).
# tests.rank_preload (imported from the directory pytest runs in, as the server's sys.path has
# it; from elsewhere it is skipped as missing) reads the built-in corpus there once, where each
# rank that trained read it again.
megart.launcher._PRELOAD = [*megart.launcher._PRELOAD, "megatron.core", "tests.rank_preload"]


# On a machine with a GPU, a launched rank of a CPU test would pick the nccl backend and its
# LOCAL_RANK's GPU (rank 1 of two finds none on a one-GPU machine), and a `megart` subprocess
# would train on the GPU: these tests are about the CPU path, so their ranks and subprocesses
# see no GPU. Tests whose ranks are meant to use one are marked gpu_ranks. The pytest process
# itself starts CUDA first, so that its own view stays: torch reads CUDA_VISIBLE_DEVICES until
# then (seen on an H100: a CUDA test run after the variable was set found no device).
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu_ranks: the ranks this test launches use the GPU")
    if torch.cuda.is_available():
        torch.cuda.init()
        torch.cuda.device_count()  # cached from here on, whatever the variable says


@pytest.fixture(autouse=True)
def _cpu_ranks_see_no_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("gpu_ranks") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# A test that trains or initialises megart.distributed in the pytest process itself, and leaves
# it initialised, breaks whichever later test calls init() (seen: test_rotary_percent trained
# in-process and test_distributed_torch_backend failed, alphabetical order hiding it). Ending it
# here and failing the test that left it names the culprit instead of its victim.
@pytest.fixture(autouse=True)
def _no_distributed_state_left_behind(request: pytest.FixtureRequest):
    import megart.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy()
        pytest.fail(f"{request.node.nodeid} left megart.distributed initialised: launch it")


@pytest.fixture(scope="module")
def torch_group_of_one(tmp_path_factory: pytest.TempPathFactory):
    """A torch.distributed group of this one process for a module's tests: Megatron-Core's
    BlendedDataset asks torch.distributed for its rank."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def moe_one_process() -> list[dict]:
    """The history of one process training moe_ep_workers.TRAIN, the curve the expert-parallel
    tests (tests/test_moe_ep*.py, test_moe.py) compare with: launched once a session."""
    import train_workers as tw
    from moe_ep_workers import TRAIN

    return megart.launcher.launch(tw.train_kw, 1, TRAIN, timeout=300)[0]
