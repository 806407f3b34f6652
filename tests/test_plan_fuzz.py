"""megart plan over random command lines of a tiny model: each either plans (exit 0, a table or
a JSON object on stdout) or is refused with one line, `megart plan: error: ...`, and exit
code 2; never an uncaught exception or a traceback. Values out of range (0, negatives, sizes
that do not divide) are drawn on purpose. PLAN_FUZZ_EXAMPLES raises the example count for a
longer hunt."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megart.cli.plan import main as plan_main
from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.errors import ConfigError

EXAMPLES = int(os.environ.get("PLAN_FUZZ_EXAMPLES", "300"))  # ~11 s on one free core

# --gpu-profile files: a good one (a built-in copied) and bad ones of each kind.
_GOOD = json.loads(
    (Path(__file__).parents[1] / "python/megart/plan/profiles/a100-80gb.json").read_text()
)
PROFILES = {
    "good": json.dumps(_GOOD),
    "not_json": "{ peak_tflops: 312",
    "a_list": "[1, 2, 3]",
    "a_number": "7",
    "missing": json.dumps({k: v for k, v in _GOOD.items() if k != "hbm_gb_per_s"}),
    "unknown": json.dumps({**_GOOD, "colour": 3}),
    "negative": json.dumps({**_GOOD, "peak_tflops": -1}),
    "string": json.dumps({**_GOOD, "memory_gib": "80"}),
    "nan": json.dumps({**_GOOD, "rail_gb_per_s": float("nan")}),
    "infinite": json.dumps({**_GOOD, "nvlink_bus_gb_per_s": float("inf")}),
    "no_room": json.dumps({**_GOOD, "workspace_gib": 90.0}),
    "fraction": json.dumps({**_GOOD, "memory_usable_fraction": 3.0}),
    "float_node": json.dumps({**_GOOD, "gpus_per_node": 8.5}),
    "name_number": json.dumps({**_GOOD, "name": 5}),
    "sources_list": json.dumps({**_GOOD, "sources": [1]}),
}


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("profiles")
    for name, text in PROFILES.items():
        (d / f"{name}.json").write_text(text)
    return d


# Values out of range, drawn for a few flags of each command line.
BAD = ("0", "-1", "-4")
SIZE = st.sampled_from(["1", "2", "4", "8", "3"])
# flag -> its plausible values (None: a switch). Given flags are drawn from these.
OPTIONAL = {
    "--tensor-model-parallel-size": SIZE,
    "--pipeline-model-parallel-size": SIZE,
    "--num-layers-per-virtual-pipeline-stage": st.sampled_from(["1", "2", "3"]),
    "--num-virtual-stages-per-pipeline-rank": st.sampled_from(["1", "2", "3"]),
    "--pipeline-schedule": st.sampled_from(["1f1b", "interleaved", "zb-h1", "zb-v"]),
    "--micro-batch-size": st.sampled_from(["1", "2", "4", "3"]),
    "--context-parallel-size": SIZE,
    "--cp-comm-type": st.sampled_from(["p2p", "all_gather", "a2a", "a2a+p2p"]),
    "--recompute-granularity": st.sampled_from(["full", "selective"]),
    "--recompute-method": st.sampled_from(["uniform", "block"]),
    "--recompute-num-layers": st.sampled_from(["1", "2", "3"]),
    "--recompute-modules": st.sampled_from(["core_attn", "layernorm mlp", "mlp", "moe"]),
    "--window-size": st.sampled_from(["16,0", "32,0", "8,8", "-1,0", "16", "0,0"]),
    "--window-attn-skip-freq": st.sampled_from(["1", "2", "3", "([1]*3+[0])*2"]),
    "--decoder-first-pipeline-num-layers": st.sampled_from(["1", "2", "3", "6"]),
    "--decoder-last-pipeline-num-layers": st.sampled_from(["1", "2", "3", "6"]),
    "--num-query-groups": st.sampled_from(["1", "2", "4", "3"]),
    "--kv-channels": st.sampled_from(["8", "16", "24", "128", "0"]),  # heads of any width
    "--ffn-hidden-size": st.sampled_from(["64", "200", "256", "1024"]),
    "--ddp-num-buckets": st.sampled_from(["1", "2", "4"]),
    "--ddp-bucket-size": st.sampled_from(["0", "1000", "40000000"]),
    "--runtime": st.sampled_from(["megart", "megatron"]),
    "--make-vocab-size-divisible-by": st.sampled_from(["1", "64", "128"]),
    "--rotary-percent": st.sampled_from(["1.0", "0.5", "0.3", "0", "2"]),
    "--position-embedding-type": st.sampled_from(["learned_absolute", "rope"]),
    "--normalization": st.sampled_from(["LayerNorm", "RMSNorm"]),
    "--rampup-batch-size": st.sampled_from(["2 2 100", "1 1 10", "0 1 10", "4 -2 10"]),
    "--hidden-dropout": st.sampled_from(["0.0", "0.1"]),
    **dict.fromkeys(
        ["--sequence-parallel", "--use-distributed-optimizer", "--fp16", "--bf16",
         "--group-query-attention", "--swiglu", "--recompute-activations",
         "--overlap-param-gather", "--no-overlap-grad-reduce", "--grad-reduce-in-bf16",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--qk-layernorm",
         "--cross-entropy-loss-fusion", "--fp32-residual-connection", "--half-weights",
         "--no-scatter-gather-tensors-in-pipeline", "--json"]
    ),
}  # fmt: skip
# The numeric flags a command line may break with a value of BAD.
BREAKABLE = (
    "--num-gpus", "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
    "--vocab-size", "--global-batch-size", "--top",
    *(f for f, values in OPTIONAL.items() if values is not None and f.endswith(("size", "layers",
      "stage", "rank", "groups", "buckets", "by", "freq"))),
)  # fmt: skip


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    """A tiny model on a small cluster, a random subset of megart train's layout and model
    flags, and at times one or two numbers broken (0 or negative)."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 8]))
    # Mostly heads of 16 to 64 channels; at times any size (heads need not divide it).
    hidden = draw(st.one_of(st.sampled_from([16, 32, 64]).map(heads.__mul__), st.integers(60, 520)))
    given = {
        "--num-gpus": draw(st.sampled_from(["1", "2", "3", "4", "6", "8", "16", "32", "64"])),
        "--num-layers": str(draw(st.integers(1, 8))),
        "--hidden-size": str(hidden),
        "--num-attention-heads": str(heads),
        "--seq-length": draw(st.sampled_from(["64", "96", "128", "256", "100"])),
        "--vocab-size": str(draw(st.integers(50, 2000))),
        "--global-batch-size": draw(st.sampled_from(["1", "2", "4", "8", "16", "24", "64"])),
        "--top": draw(st.sampled_from(["1", "2", "3"])),
    }
    for flag in draw(st.lists(st.sampled_from(sorted(OPTIONAL)), max_size=6, unique=True)):
        values = OPTIONAL[flag]
        given[flag] = None if values is None else draw(values)
    broken = draw(st.lists(st.sampled_from(BREAKABLE), max_size=2, unique=True))
    if draw(st.integers(0, 3)):  # most command lines have nothing broken
        broken = []
    for flag in broken:
        given[flag] = draw(st.sampled_from(BAD))
    argv = []
    for flag, value in given.items():
        # "=": a value that begins with "-" would otherwise read as a flag.
        argv += (
            [flag]
            if value is None
            else [f"{flag}={value}"]
            if " " not in value
            else [flag, *value.split()]
        )
    return argv


def profiles() -> st.SearchStrategy[str | None]:
    """Mostly a built-in --gpu, one time in four a --gpu-profile file (most of them bad)."""
    return st.sampled_from([None] * 3 * len(PROFILES) + list(PROFILES))


# megart plan's own flags, which megart train does not take.
PLAN_ONLY = ("--gpu", "--gpu-profile", "--num-gpus", "--top", "--json", "--runtime")


def train_refusal(argv: list[str], world: int) -> str | None:
    """What megart train says of ``argv`` on ``world`` processes without running it: its
    parser, its config, TrainConfig.check and the model's config (None: it would run)."""
    parser = FlagParser(prog="megart train")
    add_arguments(parser)
    try:
        config = config_from_args(parser.parse_args(argv))
        config.check(world)
        config.gpt_config()
    except ConfigError as e:
        return str(e)
    return None


def recommended_flags(out: str, as_json: bool) -> list[str]:
    """The recommended layout's megart train flags, from the table or the JSON object."""
    if as_json:
        return json.loads(out)["layout"]["flags"].split()
    line = next(x for x in out.splitlines() if x.startswith("recommended: megart train"))
    return line.split()[3:]


def check_plan(argv: list[str], cluster: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """megart plan ``cluster`` ``argv`` plans or refuses in one line; it never raises. A plan
    for megart's runtime recommends a layout that megart train, given ``argv`` and that
    layout, accepts."""
    code = plan_main([*cluster, *argv])
    out, err = capsys.readouterr()
    if code != 0:
        assert code == 2, (argv, code, err)
        lines = err.splitlines()
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith("megart plan: error: "), (argv, err)
        return
    assert out.strip() and not err, (argv, err)
    flags = recommended_flags(out, "--json" in argv)
    if "--runtime=megatron" in argv:
        return  # a plan for Megatron-LM's runtime, which megart train's checks do not describe
    world = next(int(x.split("=")[1]) for x in argv if x.startswith("--num-gpus="))
    train = [x for x in argv if x.split("=")[0] not in PLAN_ONLY]
    said = train_refusal([*train, *flags], world)
    assert said is None, f"megart train refuses the plan's pick {flags} of {argv}: {said}"


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(argv=command_lines(), profile=profiles())
def test_plan_plans_or_refuses_in_one_line(argv, profile, profile_dir, capsys):
    cluster = ["--gpu", "a100-80gb"] if profile is None else ["--gpu-profile"]
    if profile is not None:
        cluster.append(str(profile_dir / f"{profile}.json"))
    check_plan(argv, cluster, capsys)


# Regression tests for what the fuzzing found, each on one tiny model.
CLUSTER = ["--gpu", "a100-80gb", "--num-gpus", "8", "--top", "1"]
TINY = {
    "--num-layers": "4", "--hidden-size": "128", "--num-attention-heads": "4",
    "--seq-length": "128", "--vocab-size": "500", "--global-batch-size": "16",
}  # fmt: skip


def tiny(**changed: str) -> list[str]:
    """TINY's flags, ``changed`` (--num-layers as num_layers) replacing some."""
    flags = {**TINY, **{"--" + k.replace("_", "-"): v for k, v in changed.items()}}
    return [x for flag, value in flags.items() for x in (flag, value)]


def plan_refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """megart plan's one line of refusal of ``argv``, less its prefix."""
    code = plan_main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and not out, (argv, out)
    assert err.count("\n") == 1 and err.startswith("megart plan: error: "), err
    return err[len("megart plan: error: ") :].rstrip("\n")


@pytest.mark.parametrize(
    "profile, named",
    [
        ("a_list", "one JSON object"),
        ("a_number", "one JSON object"),
        ("nan", "rail_gb_per_s must be a finite positive number, got nan"),
        ("infinite", "nvlink_bus_gb_per_s must be a finite positive number, got inf"),
        ("no_room", "workspace_gib 90.0 leaves nothing"),
        ("fraction", "memory_usable_fraction 3.0"),
        ("name_number", "name must be a string"),
        ("sources_list", "sources must be an object"),
    ],
)
def test_a_bad_profile_is_refused_naming_its_key(profile, named, profile_dir, capsys):
    """Were a TypeError (a JSON list or number), or planned with NaN or infinite figures, a
    negative or 3x memory, a number for a name."""
    path = str(profile_dir / f"{profile}.json")
    said = plan_refusal(["--gpu-profile", path, "--num-gpus", "8", *tiny()], capsys)
    assert said.startswith(f"--gpu-profile {path}: ") and named in said, said


@pytest.mark.parametrize("flag", ["num_layers", "hidden_size", "num_attention_heads",
                                  "seq_length", "vocab_size"])  # fmt: skip
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_size_below_one_is_refused_as_megart_train_refuses_it(flag, value, capsys):
    """Were ZeroDivisionError, ValueError from the FLOPs count, or a plan of a model of no
    layers; megart train divided by zero for no heads and took the others."""
    argv = tiny(**{flag: value})
    said = plan_refusal([*CLUSTER, *argv], capsys)
    assert said.startswith(f"--{flag.replace('_', '-')} {value}: "), said
    assert train_refusal(argv, 1) == said  # on one process: refusals of no layout


@pytest.mark.parametrize(
    "changed, named",
    [
        (dict(hidden_size="130"), "--hidden-size 130 does not split into --num-attention-heads 4"),
        (dict(kv_channels="0"), "--kv-channels 0"),
        (dict(max_position_embeddings="64"), "--max-position-embeddings 64"),
        (dict(expert_model_parallel_size="2"), "--expert-model-parallel-size 2"),
        (dict(lr="-1"), "--lr -1.0"),
        (dict(train_iters="0"), "--train-iters"),
        (dict(half_weights=""), "--half-weights"),
        (dict(grad_reduce_in_bf16=""), "--grad-reduce-in-bf16"),
        (dict(hidden_dropout="2"), "--hidden-dropout 2 is a probability"),
        (dict(attention_dropout="nan"), "--attention-dropout nan is a probability"),
        (dict(recompute_granularity="bogus"), "--recompute-granularity 'bogus'"),
        (dict(recompute_method="bogus"), "--recompute-method 'bogus'"),
        # --recompute-modules where Megatron-LM ignores it, and a module megart has not.
        (dict(recompute_modules="mlp"), "--recompute-modules mlp without recomputation"),
        (
            dict(recompute_activations="", recompute_modules="moe_act"),
            "--recompute-modules moe_act (Megatron-LM recomputes the experts' activation only "
            "with --moe-grouped-gemm",
        ),
        # Found by a longer fuzz (2026-11-29): planned as one stage, no interleaving.
        (
            dict(num_layers_per_virtual_pipeline_stage="1", pipeline_model_parallel_size="1"),
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size of "
            "at least 2",
        ),
    ],
)
def test_the_plan_refuses_what_megart_train_refuses_in_its_words(changed, named, capsys):
    """Each was planned (or refused in GPTConfig's field names) where megart train refuses it,
    or (dropout, recompute spellings) was taken by both and failed later in a run."""
    argv = [x for x in tiny(**changed) if x]  # a switch's value is ""
    said = plan_refusal([*CLUSTER, *argv], capsys)
    assert named in said, said
    assert train_refusal(argv, 1) == said  # on one process: refusals of no layout


def test_an_unwritable_png_is_refused_naming_it(tmp_path, capsys):
    """Was a FileNotFoundError (no such folder) or matplotlib's ValueError (a suffix it has no
    format for) after the search."""
    pytest.importorskip("matplotlib")
    for path in (tmp_path / "no" / "such.png", tmp_path / "plan.nosuchformat"):
        said = plan_refusal([*CLUSTER, *tiny(), "--png", str(path)], capsys)
        assert said.startswith(f"--png {path}: cannot write it"), said


@pytest.mark.parametrize(
    "changed",
    [
        dict(num_layers="3", pipeline_schedule="interleaved"),
        dict(num_layers="1", pipeline_schedule="zb-v"),
        dict(pipeline_model_parallel_size="0", num_layers_per_virtual_pipeline_stage="0"),
        dict(
            num_gpus="64",
            global_batch_size="8",
            num_layers="4",
            num_layers_per_virtual_pipeline_stage="1",
            pipeline_model_parallel_size="4",
        ),
    ],  # fmt: skip
)
def test_search_picks_what_megart_train_accepts_at_the_edges(changed, capsys):
    """Picks megart.plan.search once made that megart train refuses: a one-stage layout under
    --pipeline-schedule interleaved or zb-v (now refused with train's words, or zb-v folded in
    two), and one chunk a rank under --num-layers-per-virtual-pipeline-stage with microbatches
    not a multiple of the stages (now left out)."""
    world = changed.pop("num_gpus", "8")
    argv = [*tiny(**changed), f"--num-gpus={world}"]
    check_plan(argv, ["--gpu", "a100-80gb", "--top=1"], capsys)


@pytest.mark.parametrize(
    "argv",
    [
        # Found by longer fuzz runs (2026-11-29). The pick spelt interleaving by layers, and
        # megart train refuses both spellings together:
        ["--pipeline-model-parallel-size=2", "--num-virtual-stages-per-pipeline-rank=2"],
        # The pick was full recomputation where --recompute-activations makes it selective:
        ["--recompute-activations", "--recompute-granularity=full"],
    ],
)
def test_the_pick_of_these_runs_as_megart_train(argv, capsys):
    base = ["--num-gpus=2", "--num-layers=4", "--hidden-size=16", "--num-attention-heads=1",
            "--seq-length=64", "--vocab-size=50", "--global-batch-size=2", "--top=1"]  # fmt: skip
    cluster = ["--gpu", "a100-80gb"]
    assert plan_main([*cluster, *base, *argv]) == 0, capsys.readouterr().err  # it plans
    capsys.readouterr()
    check_plan([*base, *argv], cluster, capsys)  # and megart train takes the pick
