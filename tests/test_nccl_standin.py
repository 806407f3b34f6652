"""The nccl transport's own sources (cuda/comm) built against the host stand-ins for the CUDA
runtime and NCCL (tests/standin, see BEHAVIOUR.md there) and run on CPU: every op and dtype at 2
and 4 ranks against float64, subgroups, batched p2p rings, stream ordering, dead and stuck peers,
aborts, bounded init and shutdown, and the watchdog ending a process whose peer failed. Then each
cudaStreamWaitEvent of the transport is removed in turn, and the tests must catch it.

Ranks are threads of one test process (each on its own stand-in device); each case runs in its
own process, so a case that the watchdog must end can end it."""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "standin"
COMM = ROOT / "cuda" / "comm"
WATCHDOG_EXIT = 86  # cuda/comm/nccl_watchdog.hpp


def _cases(source: str) -> list[str]:
    return re.findall(r"^TEST\((\w+)\)", (STANDIN / source).read_text(), re.M)


COLLECTIVES = _cases("test_collectives.cpp")
FAILURES = _cases("test_failures.cpp")


def _build(build: Path, comm_dir: Path = COMM) -> Path:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is needed: pip install 'megart[test]'")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (
        [cmake, "-S", str(STANDIN), "-B", str(build), *generator, f"-DMEGART_COMM_DIR={comm_dir}"],
        [cmake, "--build", str(build), "--parallel", "2"],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return build


def _lay_out(comm: Path, changed: dict[str, str] | None = None) -> None:
    """Makes `comm` a copy of cuda/comm with the texts in `changed` (file name: text) in place
    of their files, writing only the files that differ: the build recompiles only those."""
    for source in COMM.iterdir():
        want = (changed or {}).get(source.name, source.read_text())
        copy = comm / source.name
        if not copy.exists() or copy.read_text() != want:
            copy.write_text(want)


@pytest.fixture(scope="module")
def _tree(tmp_path_factory) -> tuple[Path, Path]:
    """One build of the stand-in for the module, from a copy of cuda/comm (laid out as
    cuda/comm is) that the mutation check edits in place, so that a mutant recompiles the file it
    changes, not the whole tree: (build, comm copy)."""
    work = tmp_path_factory.mktemp("standin")
    comm = work / "comm"
    comm.mkdir()
    _lay_out(comm)
    return _build(work / "build", comm), comm


def _rebuild(build: Path) -> Path:
    done = subprocess.run(
        [shutil.which("cmake") or "cmake", "--build", str(build), "--parallel", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"rebuilding {build} failed:\n{done.stdout}\n{done.stderr}"
    return build


@pytest.fixture
def standin(_tree) -> Path:
    """The stand-in built from cuda/comm as it is: a mutant left by the mutation check is put
    back and rebuilt first (otherwise the build is a no-op)."""
    build, comm = _tree
    _lay_out(comm)
    return _rebuild(build)


def _run(build: Path, cases: list[str], timeout: float = 120, **env: str):
    full = {**os.environ, "MEGART_NCCL_LIBRARY": str(build / "libnccl_standin.so"), **env}
    t0 = time.monotonic()
    done = subprocess.run(
        [str(build / "megart_nccl_standin_tests"), *cases],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
    )
    return done, time.monotonic() - t0


def test_every_case_is_collected():
    assert len(COLLECTIVES) >= 9 and len(FAILURES) >= 9


def test_standin_exports_only_nccls_c_api(standin):
    """As libnccl.so exports only NCCL's C functions, so does the stand-in (besides its own
    megartStandin controls): the transport can bind nothing else of it by accident."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs binutils' nm")
    table = subprocess.run(
        [nm, "-D", "--defined-only", str(standin / "libnccl_standin.so")],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    exported = {line.split()[-1] for line in table.splitlines() if line.strip()}
    assert {"ncclCommInitRank", "ncclAllReduce", "ncclGroupEnd"} <= exported
    others = sorted(s for s in exported if not s.startswith(("nccl", "megartStandin")))
    assert not others, others


@pytest.mark.parametrize("case", COLLECTIVES + [c for c in FAILURES if "ends_the" not in c])
def test_standin_case(standin, case):
    done, _ = _run(standin, [case], MEGART_NCCL_WATCHDOG="0")
    assert done.returncode == 0 and "1 tests, 0 failed" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(
    "case, says",
    [
        ("dead_peer_ends_the_process", "remote process exited"),
        ("stuck_peer_ends_the_process", "timed out after 1000 ms waiting for ranks 0..1"),
    ],
)
def test_watchdog_ends_the_process(standin, case, says):
    """Nobody waits on the failed op: the watchdog aborts the communicator and ends the process
    within the timeout plus a few seconds, naming rank, op, peers and group."""
    done, took = _run(standin, [case], MEGART_NCCL_WATCHDOG="1")
    assert done.returncode == WATCHDOG_EXIT, done.stdout + done.stderr
    message = done.stderr
    assert "rank 0 of group 'world'" in message and "all_reduce(16 x float32, sum)" in message
    assert says in message and "ranks 0..1" in message and "watchdog ended" in message
    assert took < 1 + 5


@pytest.mark.parametrize(
    "version, cases",
    [
        # NCCL before 2.14: blocking ncclCommInitRank only; ops as before.
        ("21300", COLLECTIVES),
        # 2.14 to 2.17: non-blocking, no ncclCommSplit: ops run on the non-blocking communicator.
        ("21700", COLLECTIVES + ["stuck_peer_times_out_at_wait", "dead_peer_raises_at_wait"]),
    ],
)
def test_older_nccl(standin, version, cases):
    done, _ = _run(standin, cases, MEGART_NCCL_WATCHDOG="0", MEGART_STANDIN_NCCL_VERSION=version)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(cases)} tests, 0 failed" in done.stdout


def _stream_waits() -> list[tuple[str, int]]:
    sites = []
    for source in sorted(COMM.glob("*.cpp")):
        calls = re.findall(r"cudaStreamWaitEvent\(", source.read_text())
        sites += [(source.name, k) for k in range(len(calls))]
    return sites


def _without_call(text: str, k: int) -> str:
    """`text` with the k-th cudaStreamWaitEvent(...) call replaced by cudaSuccess."""
    starts = [m.start() for m in re.finditer(r"cudaStreamWaitEvent\(", text)]
    start = starts[k]
    depth, end = 0, start
    for end in range(start + len("cudaStreamWaitEvent"), len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
    return text[:start] + "cudaSuccess" + text[end + 1 :]


def test_the_transport_has_stream_waits_to_remove():
    assert len(_stream_waits()) >= 4


@pytest.mark.parametrize("source, k", _stream_waits())
def test_each_stream_wait_is_needed(_tree, source, k):
    """Removing any one cudaStreamWaitEvent from the transport makes a stand-in test fail: the
    stand-in's streams really overlap, so a missing ordering is a wrong result, not luck. (The
    mutant is built in the module's stand-in build, recompiling only the files that differ from
    the last build; the `standin` fixture puts cuda/comm back for any test that runs after.)"""
    build, comm = _tree
    _lay_out(comm, {source: _without_call((COMM / source).read_text(), k)})
    assert (comm / source).read_text() != (COMM / source).read_text()
    _rebuild(build)
    done, _ = _run(build, COLLECTIVES, MEGART_NCCL_WATCHDOG="0")
    assert done.returncode != 0, f"{source}: removing stream wait #{k} went unnoticed"
    assert "FAILED" in done.stdout
