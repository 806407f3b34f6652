"""What a new user and a failing job meet first (issue 17): help, a restartable job's first
run, configuration errors under several ranks, a rendezvous missing a rank, torchrun's store,
damaged checkpoints, and a /dev/shm too small. Real processes, each with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from megart._core import comm

from megart import ConfigError, MegartError
from megart.cli.main import COMMANDS
from megart.launcher import free_port
from megart.training import checkpoint, checkpoint_dirs, checksum

TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 2 --eval-iters 0"
).split()


def run(
    args: list[str], env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, **(env or {})),
    )


@pytest.mark.parametrize("args", [["--help"], [], ["help"]])
def test_help_lists_every_command_and_exits_0(args):
    out = run(["-m", "megart", *args], timeout=120)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(COMMANDS)
    assert "megart COMMAND --help" in out.stdout


def test_an_unknown_command_lists_the_commands_and_exits_2():
    out = run(["-m", "megart", "trian"], timeout=120)
    assert out.returncode == 2 and "unknown command 'trian'" in out.stderr
    assert all(name in out.stderr for name in COMMANDS)


def test_first_run_of_a_restartable_job_then_a_damaged_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    out = run(
        ["-m", "megart", "train", *TINY, "--train-iters", "2", "--save", str(ck), "--load", str(ck)]
    )
    assert out.returncode == 0, out.stderr
    assert f"--load {ck} holds no checkpoint yet: starting from scratch" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("megart train: done: 2 iterations")
    f = ck / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the tensors
    f.write_bytes(bytes(data))
    out = run(["-m", "megart", "train", *TINY, "--train-iters", "3", "--load", str(ck)])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{f} is damaged: its SHA-256 is" in out.stderr
    f.write_bytes(b"")  # the loader's own path, in this process
    with pytest.raises(ConfigError, match=r"is empty \(0 bytes\)") as e:
        checkpoint.read_file(f)
    assert str(f) in str(e.value) and "_use_new_zipfile_serialization" not in str(e.value)


def test_bad_flags_and_an_unwritable_save_are_refused_before_any_work(tmp_path):
    out = run(["-m", "megart", "train", *TINY, "--micro-batch-size", "0"], timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--micro-batch-size 0 and --global-batch-size 2 must be at least 1" in out.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = run(["-m", "megart", "train", *TINY, "--save", str(blocker / "ck")], timeout=120)
    assert out.returncode == 2 and f"--save {blocker / 'ck'} cannot be written" in out.stderr
    assert "iteration" not in out.stdout  # refused before training
    # A misspelt flag: one line naming the flag it resembles, not argparse's 70-line usage.
    out = run(["-m", "megart", "train", *TINY, "--micro-bach-size", "2"], timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--micro-bach-size: did you mean --micro-batch-size?" in out.stderr


def test_a_config_error_under_two_ranks_is_printed_once_with_the_same_status():
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "megart", "train", *TINY, "--tensor-model-parallel-size", "3"],
            env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_PORT=port, LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    errs = [e for _, e in outs]
    assert "2 processes do not split into tensor-parallel 3" in errs[0]
    assert "torchrun --nproc-per-node N" in errs[0]
    assert errs[1].strip() == "" and "Traceback" not in errs[0]


def test_an_error_in_one_ranks_own_environment_is_said_by_that_rank():
    # Rank 0 would say a flag error for everyone; this one only rank 5 can find.
    args = ["-m", "megart", "train", *TINY, "--global-batch-size", "4"]  # right for 2 ranks
    out = run(args, env=dict(RANK="5", WORLD_SIZE="2"), timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "megart train: error: RANK=5 is outside WORLD_SIZE=2" in out.stderr


def test_a_rank_alone_says_whom_it_waits_for_and_gives_up():
    code = "import megart.distributed as d; d.init(backend='shm', timeout=4)"
    env = dict(RANK="0", WORLD_SIZE="2", MASTER_PORT=str(free_port()))
    out = run(["-c", code], env=env, timeout=120)
    assert out.returncode != 0
    assert "rank 0 is waiting at 127.0.0.1:" in out.stderr and "for rank(s) [1]" in out.stderr
    assert "rank(s) [1] of WORLD_SIZE=2 did not join the rendezvous" in out.stderr


def torchrun(script: Path, nproc: int) -> subprocess.CompletedProcess:
    """torchrun with this interpreter, whatever PATH holds, on a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_under_torchrun_ranks_use_the_agents_store_without_a_bind_error(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, megart.distributed as d\n"
        "d.init(backend='shm', timeout=60)\n"
        "t = torch.ones(3); d.all_reduce(t); assert t.tolist() == [2.0] * 3\n"
        "import sys; sys.stdout.write(f'ok {d.get_rank()}\\n'); sys.stdout.flush()\n"
    )
    out = torchrun(script, 2)
    assert out.returncode == 0, out.stderr
    # One write per line, so the two ranks' lines never interleave.
    assert sorted(out.stdout.split("\n")[:2]) == ["ok 0", "ok 1"]
    assert "failed to bind" not in out.stderr, out.stderr


def test_under_torchrun_init_after_destroy_takes_fresh_keys(tmp_path):
    """torchrun's agent store outlives destroy(): a second init() that read the first one's
    keys attached to shared memory its creator had replaced and waited out the timeout (seen:
    megart selftest under torchrun). Rank 0, who creates each group, comes last every round,
    so the others read whatever the store holds before it writes."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time, torch, megart.distributed as d\n"
        # A function, so that each round's groups are gone before the interpreter's shutdown
        # (destroy() also lets go of their torch groups, test_distributed_torch_backend).
        "def one_round():\n"
        "    if os.environ['RANK'] == '0': time.sleep(0.5)\n"
        "    d.init(backend='shm', timeout=20)\n"
        "    t = torch.ones(3); d.all_reduce(t); assert t.tolist() == [3.0] * 3\n"
        "    g = d.new_group(backend='torch'); u = torch.ones(2); d.all_reduce(u, group=g)\n"
        "    assert u.tolist() == [3.0] * 2\n"
        "    d.destroy()\n"
        "for i in range(3):\n"
        "    one_round()\n"
        "sys.stdout.write('ok\\n'); sys.stdout.flush()\n"
    )
    out = torchrun(script, 3)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["ok"] * 3


def test_megart_train_ends_the_groups_it_started():
    """Under torchrun, `megart train --distributed-backend torch` left its torch.distributed
    groups to the interpreter's shutdown, where gloo aborted 3 of 16 finished runs on a loaded
    machine; main() now ends them once training is done (0 of 24)."""
    import torch.distributed as td

    import megart.distributed as dist
    from megart.cli.train import main

    tiny = "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16"
    flags = f"{tiny} --global-batch-size 2 --micro-batch-size 2 --train-iters 1 --eval-iters 0"
    assert main([*flags.split(), "--distributed-backend", "torch"]) == 0
    assert not dist.is_initialized() and not td.is_initialized()


def test_a_segment_larger_than_dev_shm_is_refused_naming_the_size():
    with pytest.raises(MegartError, match=r"needs \d+ MiB but /dev/shm has \d+ MiB free"):
        comm.create_shm(f"/megart-test-{os.getpid()}", "big", 0, 1, staging_bytes=1 << 50)
    assert not Path(f"/dev/shm/megart-test-{os.getpid()}").exists()


def test_checksums_name_the_file_and_stale_partials_go(tmp_path):
    f = tmp_path / "model_optim_rng.pt"
    f.write_bytes(b"x" * 1000)
    checksum.write(f)
    checksum.verify(f)  # intact
    f.write_bytes(b"x" * 999 + b"y")
    with pytest.raises(ConfigError, match=f"{f} is damaged"):
        checksum.verify(f)
    for name in ("iter_0000001.partial", "iter_0000003.partial", "iter_0000002"):
        (tmp_path / name).mkdir()
    checkpoint_dirs.remove_stale_partials(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == [
        "iter_0000002",
        "iter_0000003.partial",
    ]
    assert not checkpoint_dirs.no_checkpoint_yet(tmp_path)  # an iter_ folder: damaged, not new
    assert checkpoint_dirs.no_checkpoint_yet(tmp_path / "missing")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_peer_that_died_before_joining_is_noticed_at_once():
    import time

    dead, me = _dead_pid(), os.getpid()
    name = f"/megart-test-{me}-join"
    start = time.monotonic()
    # Rank 0 waits for rank 1 to attach; rank 1's pid (from the rendezvous) is gone.
    with pytest.raises(
        MegartError, match=r"joining the group failed: global rank 1 \(pid \d+\) has"
    ):
        comm.create_shm(
            name,
            "g",
            0,
            2,
            timeout_s=60,
            pids=[me, dead],
            global_ranks=[0, 1],
            labels=["global rank 0", "global rank 1"],
        )
    # Rank 1 waits for rank 0 to create the segment; rank 0 is gone.
    with pytest.raises(
        MegartError, match=r"rank 0 of the group \(pid \d+\) exited before creating"
    ):
        comm.create_shm(name + "b", "g", 1, 2, timeout_s=60, pids=[dead, me])
    assert time.monotonic() - start < 10  # not the 60 s timeout
    assert not Path(f"/dev/shm{name}").exists()  # the failing rank removed the name


@pytest.mark.parametrize(
    "nproc, flags, says",
    [
        (2, ["--micro-batch-size", "0"], "--micro-batch-size 0 and --global-batch-size 2 must"),
        # 4 ranks: the agent sees them exit in several looks (2 often exit in the same one).
        (4, ["--tensor-model-parallel-size", "3"], "4 processes do not split into tensor-parall"),
    ],
)
def test_a_config_error_under_torchrun_ends_its_report_once(nproc, flags, says):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        + ["--master-port", str(free_port()), "-m", "megart", "train", *TINY, *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    # Said once, by rank 0, as the root cause that ends torchrun's report (not above it, where
    # the report would bury it); the other rank points at it.
    assert out.stderr.count(says) == 1, out.stderr
    root = out.stderr.rsplit("Root Cause (first observed failure):", 1)[1]
    assert (
        "rank      : 0 (local_rank: 0)" in root
        and f"traceback : megart train: error: {says}" in root
    )
    pointers = out.stderr.count("stopped by the configuration error that rank 0 reports")
    assert pointers == nproc - 1, out.stderr
    # Every rank exits with 2 by itself (the agent's SIGTERM, sent to whoever it finds still
    # running, ends none: no -15), and without a traceback of megart's.
    assert out.stderr.count("exitcode  : 2 (pid") == nproc, out.stderr
    assert "exitcode  : -" not in out.stderr
    assert not any("megart" in line for line in out.stderr.splitlines() if "File " in line)
