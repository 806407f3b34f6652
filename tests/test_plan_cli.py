"""megart plan's command line: the JSON's keys and the table's recommended flags, flags
planned as megart train runs them (--fp32-residual-connection, --half-weights), and its errors:
bad layouts in megart train's words, layouts megart's rank grid refuses, a model that fits
nowhere, a broken --gpu-profile."""

from __future__ import annotations

import json

import pytest

from megart.cli.main import main as megart_main
from megart.errors import ConfigError
from megart.plan import Fixed, load_profile, search
from megart.plan.hardware import PROFILE_DIR
from megart.training.config import TrainConfig
from test_plan import MODEL

BIG = [
    "--num-layers",
    "24",
    "--hidden-size",
    "2048",
    "--num-attention-heads",
    "16",
    "--seq-length",
    "2048",
    "--vocab-size",
    "51200",
    "--global-batch-size",
    "256",
]


def test_json_has_the_documented_keys(capsys, tmp_path):
    png = tmp_path / "plan.png"
    code = megart_main(
        [
            "plan",
            "--gpu",
            "a100-80gb",
            "--num-gpus",
            "32",
            *BIG,
            "--json",
            "--png",
            str(png),
            "--top",
            "3",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "iteration_time_s",
        "tflops_per_gpu",
        "model_tflops_per_gpu",
        "mfu",
        "memory_gib",
        "layout",
        "candidates",
    ):
        assert key in out
    assert set(out["memory_gib"]) >= {
        "parameters",
        "gradients",
        "optimizer",
        "activations",
        "total",
    }
    assert len(out["candidates"]) == 3 and out["candidates"][0]["why"] == "recommended"
    assert out["tflops_per_gpu"] >= out["model_tflops_per_gpu"] > 0
    times = [c["iteration_time_s"] for c in out["candidates"]]
    assert times == sorted(times)
    assert png.stat().st_size > 1000


def test_the_table_names_the_recommended_flags(capsys):
    assert megart_main(["plan", "--gpu", "h100-80gb", "--num-gpus", "16", *BIG]) == 0
    out = capsys.readouterr().out
    assert "recommended: megart train --tensor-model-parallel-size" in out


def test_fp32_residual_connection_is_planned_as_megart_train_runs_it(capsys):
    """--fp32-residual-connection (megart train's and Megatron's flag) keeps the residual
    stream fp32: the same layout's worst rank holds more activations and more in all, and the
    iteration is no faster (the pipeline's messages carry twice the bytes, mostly hidden behind
    compute). Which rank is worst can change, so its weights are not compared."""
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"]
    out = {}
    for wide in (False, True):
        flags = [*BIG, *layout, "--micro-batch-size", "1", "--bf16", "--json"]
        flags += ["--fp32-residual-connection"] if wide else []
        assert megart_main(["plan", "--gpu", "a100-80gb", "--num-gpus", "64", *flags]) == 0
        out[wide] = json.loads(capsys.readouterr().out)
    narrow, wide = out[False], out[True]
    for part in ("activations", "total"):
        assert narrow["memory_gib"][part] < wide["memory_gib"][part]
    assert narrow["iteration_time_s"] <= wide["iteration_time_s"]


def test_half_weights_are_planned_as_megart_train_holds_them(capsys):
    """--half-weights: half the weights' bytes, no autocast copies, 4 bytes a stepped element
    more optimizer state; with the distributed optimizer over d = 8 that is less in all."""
    flags = [*BIG, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    flags += ["--micro-batch-size", "1", "--bf16", "--use-distributed-optimizer", "--json"]
    out = {}
    for half in (False, True):
        more = ["--half-weights"] if half else []
        assert megart_main(["plan", "--gpu", "a100-80gb", "--num-gpus", "32", *flags, *more]) == 0
        out[half] = json.loads(capsys.readouterr().out)["memory_gib"]
    fp32, half = out[False], out[True]
    assert half["parameters"] == pytest.approx(fp32["parameters"] / 2)
    assert half["gradients"] == fp32["gradients"] and half["autocast_copies"] == 0
    assert half["optimizer"] == pytest.approx(fp32["optimizer"] * 1.5, rel=1e-3)
    assert half["total"] < fp32["total"]


@pytest.mark.parametrize(
    "flags,train_flags",
    [
        (["--micro-batch-size", "3"], dict(micro_batch_size=3)),
        (["--pipeline-model-parallel-size", "5"], dict(pipeline_model_parallel_size=5)),
        (["--tensor-model-parallel-size", "3"], dict(tensor_model_parallel_size=3)),
        (
            [
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "5",
            ],
            dict(
                tensor_model_parallel_size=2,
                pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=5,
            ),
        ),
    ],
)
def test_bad_layouts_get_megart_trains_errors(flags, train_flags, capsys):
    code = megart_main(["plan", "--gpu", "a100-80gb", "--num-gpus", "16", *BIG, *flags])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megart plan: error: ") and err.count("\n") == 0
    cfg = TrainConfig(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        seq_length=2048,
        vocab_size=51200,
        global_batch_size=256,
        **train_flags,
    )
    try:
        cfg.check(16)
        from megart.parallel.checks import check_model_fits
        from megart.parallel.layout import make_layout

        check_model_fits(make_layout(16, cfg.tp, cfg.pp), 24, 16)
    except ConfigError as e:
        assert str(e) in err
    else:
        raise AssertionError("megart train accepts this layout")


def test_layouts_megarts_grid_refuses_are_not_recommended(capsys):
    """megart's rank grid refuses a pipeline hop between nodes that changes rail (tp 2 x dp 2
    puts stages 4 ranks apart, so a 4-stage pipeline spans two 8-GPU nodes on different
    rails): the planner for megart's runtime neither recommends such a layout nor accepts it
    when asked, with megart train's message; Megatron-LM's runtime has no such rule."""
    from megart.parallel.layout import make_layout

    gpu = load_profile("a100-80gb")
    base = TrainConfig(**{**MODEL, "global_batch_size": 64})
    for world in (16, 32, 64):
        for e in search(base, world, gpu, keep=200):
            make_layout(world, e.layout.tp, e.layout.pp, gpus_per_node=gpu.gpus_per_node)
    asked = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"]
    code = megart_main(["plan", "--gpu", "a100-80gb", "--num-gpus", "16", *BIG, *asked])
    assert code == 2
    with pytest.raises(ConfigError) as refused:
        make_layout(16, 2, 4, gpus_per_node=8)
    assert str(refused.value) in capsys.readouterr().err
    megatron = search(base, 16, gpu, Fixed(tp=2, pp=4), runtime="megatron")
    assert megatron and (megatron[0].layout.tp, megatron[0].layout.pp) == (2, 4)


def test_a_model_that_fits_nowhere_says_how_much_is_missing(capsys):
    code = megart_main(
        [
            "plan",
            "--gpu",
            "a100-80gb",
            "--num-gpus",
            "8",
            "--num-layers",
            "96",
            "--hidden-size",
            "12288",
            "--num-attention-heads",
            "96",
            "--global-batch-size",
            "64",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "no layout fits" in err and "GiB more than" in err


def test_a_copied_profile_is_used_and_a_broken_one_refused(tmp_path, capsys):
    src = json.loads((PROFILE_DIR / "a100-80gb.json").read_text())
    mine = dict(src, name="my-a100-40gb", memory_gib=40.0)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine))
    assert (
        megart_main(["plan", "--gpu-profile", str(path), "--num-gpus", "32", *BIG, "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["gpu"] == "my-a100-40gb" and out["usable_memory_gib"] < 40
    del mine["rail_gb_per_s"]
    path.write_text(json.dumps(mine))
    assert megart_main(["plan", "--gpu-profile", str(path), "--num-gpus", "32", *BIG]) == 2
    assert "missing rail_gb_per_s" in capsys.readouterr().err
