"""megart-bench schedule as a user runs it: the table, the JSON shape, the picture, the errors."""

import json
import subprocess
import sys

import pytest


def bench(*args):
    return subprocess.run(
        [sys.executable, "-m", "megart.cli.bench", "schedule", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_default_run_compares_every_kind():
    out = bench()
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}
    for kind, row in rows.items():
        assert row[4] == row[5], f"{kind}: simulated bubble {row[4]} != theory {row[5]}"
    assert rows["1f1b"][-4:] == ["4", "3", "2", "1"]  # peak in flight per rank
    assert rows["zb-h1"][-4:] == ["4", "4", "4", "4"]  # F to W: p on every rank
    assert rows["zb-v"][-4:] == ["8", "8", "8", "8"]  # 2p half-size chunks


@pytest.mark.parametrize(("kind", "chunks", "bubble"), [("zb-h1", 1, 3 / 24), ("zb-v", 2, 3 / 48)])
def test_json_of_zero_bubble_kinds_has_i_and_w(kind, chunks, bubble):
    out = bench("--kind", kind, "-p", "4", "-m", "8", "--chunks", str(chunks), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for actions in data["ranks"]:
        ops = [a["op"] for a in actions]
        assert ops.count("F") == ops.count("I") == ops.count("W") == 8 * chunks
        assert "B" not in ops
    assert data["chunks"] == chunks
    assert data["bubble_fraction"] == pytest.approx(bubble)
    assert data["theoretical_bubble"] == pytest.approx(bubble)


def test_json_has_every_ranks_actions_and_the_figures():
    out = bench(
        "--kind", "interleaved", "--stages", "4", "--microbatches", "8", "--chunks", "2", "--json"
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["ranks"]) == 4
    ops = {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    for actions in data["ranks"]:
        assert sum(a["op"] == "F" for a in actions) == 8 * 2
        for a in actions:
            assert a["op"] in ops and isinstance(a["mb"], int) and isinstance(a["chunk"], int)
            assert ("peer" in a) == (a["op"] not in ("F", "B"))
    assert data["bubble_fraction"] == pytest.approx(3 / 16)
    assert data["theoretical_bubble"] == pytest.approx(3 / 16)
    assert len(data["peak_in_flight"]) == 4 and data["makespan"] > 0


def test_latency_appears_in_the_makespan():
    free = json.loads(bench("--kind", "1f1b", "--json").stdout)
    slow = json.loads(bench("--kind", "1f1b", "--json", "--latency", "0.5").stdout)
    assert slow["makespan"] > free["makespan"]


def test_png_is_written(tmp_path):
    png = tmp_path / "timeline.png"
    out = bench("--png", str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--kind", "interleaved", "-p", "4", "-m", "6"],
            "the number of microbatches (6) to be a multiple of the pipeline size (4)",
        ),
        (["--kind", "1f1b", "--chunks", "2"], "--chunks 2 needs --kind interleaved"),
        (["--kind", "zb-v", "-p", "4", "-m", "6"], "use 8 or more microbatches"),
        (["--kind", "zb-v", "--chunks", "3"], "zb-v runs exactly 2 chunks"),
        (["--json"], "--json prints one schedule: add --kind"),
        (["--kind", "gpipe", "--forward-time", "-1"], "non-negative"),
    ],
)
def test_invalid_arguments_exit_nonzero_with_one_line(args, message):
    out = bench(*args)
    assert out.returncode != 0
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_the_legend_explains_every_shade_drawn():
    from megart import schedule
    from megart.schedule.draw import legend_entries

    s = schedule.build("interleaved", stages=2, microbatches=4, chunks=2)
    sim = schedule.simulate(s, forward_time=1, backward_time=2)
    entries = legend_entries([(s, sim)])
    # Two ops (forward, backward) x two chunks: four shades, four distinct entries.
    assert [label for label, _ in entries] == [
        "forward, chunk 0",
        "forward, chunk 1",
        "backward, chunk 0",
        "backward, chunk 1",
    ]
    assert len({colour for _, colour in entries}) == 4
    one = schedule.build("1f1b", stages=2, microbatches=4)
    assert [label for label, _ in legend_entries([(one, schedule.simulate(one, 1, 2))])] == [
        "forward",
        "backward",
    ]
