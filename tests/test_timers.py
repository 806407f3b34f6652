"""--timing-log-level, --timing-log-option and --log-timers-to-tensorboard: Megatron-LM's
per-phase timers (megart.training.timers), gathered from every rank every --log-interval
iterations, printed in Megatron's format and written to TensorBoard as <name>-time."""

import pytest

import megatron_workers as mw
import train_workers as tw
from megart.launcher import launch
from megart.training.timers import LEVELS, timer_lines

LEVEL_1 = [n for n, level in LEVELS.items() if level == 1]


def test_megatrons_report_formats():
    times = {"forward-backward": [12.0, 10.5], "optimizer": [0.0, 3.25]}  # rank 0 ran no step
    assert timer_lines(times, "minmax") == (
        "(min, max) time across ranks (ms):\n"
        "    forward-backward ...............................: (10.50, 12.00)\n"
        "    optimizer ......................................: (3.25, 3.25)"
    )
    assert timer_lines(times, "max").splitlines()[0] == "max time across ranks (ms):"
    assert timer_lines(times, "all") == (
        "times across ranks (ms):\n  forward-backward:\n     rank  0: 12.00\n     rank  1: 10.50\n"
        "  optimizer:\n     rank  1: 3.25"
    )
    assert timer_lines({}, "minmax") is None


@pytest.mark.parametrize("level", [1, 2])
def test_every_rank_reports_every_ranks_phases_every_log_interval(level):
    kw = dict(train_iters=4, log_interval=2, timing_log_level=level, tensor_model_parallel_size=2)
    ranks = launch(tw.train_kw, 2, kw, timeout=300)
    for history in ranks:
        assert [("timers_ms" in h) for h in history] == [False, True, False, True]
        for h in history[1::2]:
            times = h["timers_ms"]
            want = LEVEL_1 + (["batch-generator"] if level == 2 else [])
            # fp32 (no loss scale to unscale with) and no zero count asked for: not run.
            want = [n for n in want if n not in ("optimizer-unscale-and-check-inf",
                                                 "optimizer-count-zeros")]  # fmt: skip
            assert list(times) == want
            assert all(len(per_rank) == 2 and min(per_rank) > 0 for per_rank in times.values())
    assert ranks[0][1]["timers_ms"] == ranks[1][1]["timers_ms"]  # gathered: the same everywhere
    for h in ranks[0][1::2]:
        # Nested in the iteration, per iteration of the interval: reset at every report.
        interval = [x["time_s"] * 1e3 for x in ranks[0][h["iteration"] - 2 : h["iteration"]]]
        assert h["timers_ms"]["forward-backward"][0] < sum(interval) / 2
        assert h["timers_ms"]["optimizer-inner-step"][0] < h["timers_ms"]["optimizer"][0]


def test_the_cli_prints_them_and_tensorboard_gets_the_max(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    argv = ["--train-iters", "2", "--log-interval", "1", "--timing-log-level", "1",
            "--timing-log-option", "max", "--log-timers-to-tensorboard", "--log-jsonl",
            str(tmp_path / "log.jsonl"), "--tensorboard-dir", str(tmp_path / "tb"),
            "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0"]  # fmt: skip
    status, out = launch(mw.run_cli, 1, argv, timeout=300)[0]
    assert status == 0, out
    assert out.count("max time across ranks (ms):") == 2, out
    assert "    forward-backward ...............................: " in out
    import json

    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    board = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    written = [e.value for e in board.Scalars("forward-backward-time")]
    assert written == pytest.approx([max(h["timers_ms"]["forward-backward"]) for h in logged])
