"""megart plan keeps full recomputation's spans that the command line gives, even megart
train's defaults spelt out (--recompute-method uniform --recompute-num-layers 1, Megatron's
usual spelling): only spans left out are searched (block N, megart.plan.block_spans). Checked
on a model that needs recomputation to fit (8 layers on 2 GPUs, usable memory between block 1's
and block 2's), at the command line (the JSON and its printed megart train command, read back
by megart train's parser) and through the Python API (search with Fixed)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from megart.cli.main import main as megart_main
from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.plan.estimate import estimate
from megart.plan.hardware import GIB, PROFILE_DIR, GPUProfile, load_profile
from megart.plan.layout import Layout
from megart.plan.search import Fixed, search
from megart.training.config import TrainConfig

A100 = load_profile("a100-80gb")
MODEL = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=4096,
             vocab_size=32000, global_batch_size=8)  # fmt: skip
BASE = TrainConfig(bf16=True, **MODEL)
# The layout fixed but the recomputation and the schedule (searched): t1 p2 b1 on 2 GPUs.
LAYOUT = Layout(1, 2, 1, 1, 1, False, "full", False)
FIXED = Fixed(tp=1, pp=2, micro_batch=1)
MODEL_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
FLAGS = [*MODEL_FLAGS, "--tensor-model-parallel-size=1", "--pipeline-model-parallel-size=2",
         "--micro-batch-size=1"]  # fmt: skip


def _memory(n: int | None) -> float:
    """GiB of LAYOUT's worst rank under block ``n`` (None: without recomputation)."""
    spans = dict(recompute_method="block", recompute_num_layers=n) if n else {}
    lay = dataclasses.replace(LAYOUT, recompute="full" if n else None, **spans)
    return estimate(BASE, lay, A100, simulate=False).memory["total"] / GIB


@pytest.fixture(scope="module")
def gpu_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, GPUProfile]:
    """A profile (the A100's but its memory) whose usable memory fits block 2 but not block 1
    nor the layout without recomputation: the search's block N is 2 there."""
    block1, block2, plain = _memory(1), _memory(2), _memory(None)
    assert plain > block1 > block2
    usable = (block1 + block2) / 2
    profile = json.loads((PROFILE_DIR / "a100-80gb.json").read_text())
    profile["memory_gib"] = (usable + profile["workspace_gib"]) / profile["memory_usable_fraction"]
    path = tmp_path_factory.mktemp("gpu") / "small.json"
    path.write_text(json.dumps(profile))
    return str(path), load_profile(None, str(path))


def _plan(gpu_file: tuple[str, GPUProfile], extra: list[str], capsys) -> dict:
    code = megart_main(["plan", "--gpu-profile", gpu_file[0], "--num-gpus", "2", "--json",
                        "--top", "24", *FLAGS, *extra])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _train_config(flags: str) -> TrainConfig:
    """The printed flags (with the model's) as megart train's parser reads them."""
    p = FlagParser(prog="megart train")
    add_arguments(p)
    args: argparse.Namespace = p.parse_args([*MODEL_FLAGS, *flags.split()])
    return config_from_args(args)


def _spans(candidates: list[dict]) -> set[tuple]:
    """(granularity, method, N) that each candidate's printed command runs."""
    out = set()
    for c in candidates:
        cfg = _train_config(c["layout"]["flags"])
        full = cfg.recompute_granularity == "full"
        out.add((cfg.recompute_granularity, *((cfg.recompute_method, cfg.recompute_num_layers)
                                              if full else (None, None))))  # fmt: skip
    return out


def test_spans_left_out_are_searched(gpu_file, capsys):
    """The control: no spans given, the recommendation is block 2 (the smallest N that fits),
    its command carries it, and it is the Python API's answer with Fixed left at its default."""
    plan = _plan(gpu_file, [], capsys)
    assert _spans([plan]) == {("full", "block", 2)}
    assert ("full", "block", 2) in _spans(plan["candidates"])
    best = search(BASE, 2, gpu_file[1], FIXED, keep=24)[0]
    assert plan["layout"]["flags"] == best.layout.flags(8)


@pytest.mark.parametrize(
    "given",
    [
        ["--recompute-method", "uniform", "--recompute-num-layers", "1"],
        ["--recompute-method=uniform"],
        ["--recompute-num-layers", "1"],
        ["--recompute-granularity", "full"],
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ],  # fmt: skip
)
def test_given_uniform_1_is_kept(gpu_file, capsys, given):
    """megart train's defaults given (or the granularity full given): every candidate's command
    runs uniform 1, none block N, and the recommendation is full recomputation, the same as
    the Python API's with Fixed.spans."""
    plan = _plan(gpu_file, given, capsys)
    full = {("full", "uniform", 1)}
    assert _spans(plan["candidates"]) - {(None, None, None), ("selective", None, None)} == full
    assert _spans([plan]) == full
    fixed = dataclasses.replace(FIXED, spans=True)
    if "full" in given:
        fixed = dataclasses.replace(fixed, recompute="full")
    best = search(BASE, 2, gpu_file[1], fixed, keep=24)[0]
    assert plan["layout"]["flags"] == best.layout.flags(8)
    assert plan["iteration_time_s"] == best.iteration_time


def test_given_block_is_kept_and_selective_plans_no_spans(gpu_file, capsys):
    """Block 3 given: every full candidate runs block 3. Selective given (or Megatron's
    --recompute-activations) on a GPU where it fits: every candidate selective, no spans
    printed."""
    plan = _plan(gpu_file, ["--recompute-method", "block", "--recompute-num-layers", "3"], capsys)
    assert _spans(plan["candidates"]) - {(None, None, None), ("selective", None, None)} == {
        ("full", "block", 3)
    }
    for flag in (["--recompute-granularity", "selective"], ["--recompute-activations"]):
        code = megart_main(["plan", "--gpu", "a100-80gb", "--num-gpus", "2", "--json", *FLAGS,
                            *flag])  # fmt: skip
        out = json.loads(capsys.readouterr().out)
        assert code == 0
        assert _spans(out["candidates"]) == {("selective", None, None)}
        assert all("--recompute-method" not in c["layout"]["flags"] for c in out["candidates"])


def test_python_api_keeps_its_default(gpu_file):
    """Fixed() searches the spans of a base at megart train's defaults; Fixed(spans=True)
    keeps them; a base with other spans keeps them with Fixed() too."""
    gpu = gpu_file[1]

    def spans(base: TrainConfig, fixed: Fixed) -> set[tuple]:
        found = search(base, 2, gpu, fixed, keep=24)
        return {e.layout.spans for e in found if e.layout.recompute == "full"}

    assert ("block", 2) in spans(BASE, FIXED)
    assert spans(BASE, dataclasses.replace(FIXED, spans=True)) == {("uniform", 1)}
    block3 = dataclasses.replace(BASE, recompute_method="block", recompute_num_layers=3)
    assert spans(block3, FIXED) == {("block", 3)}
