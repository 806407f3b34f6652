"""Every flag of Megatron-LM's parser (tests/data/megatron_flag_names.txt, its names at a
recorded commit) is either taken by megart train's parser or refused by name at parse time, with
why: never argparse's "unrecognized arguments" nor a "did you mean" pointing at an unrelated
megart flag. The aliases megart takes give the config their megart spelling gives."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from megart.cli.train import FlagParser, add_arguments, config_from_args
from megart.cli.train import main as train_main
from megart.errors import ConfigError
from megart.training import megatron_refusals

NAMES_FILE = Path(__file__).parent / "data" / "megatron_flag_names.txt"


def megatron_flags() -> list[str]:
    lines = NAMES_FILE.read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def parser() -> FlagParser:
    p = FlagParser(prog="megart train")
    add_arguments(p)
    return p


def values_for(action: argparse.Action) -> list[str]:
    """Values megart's own parser takes for ``action``'s flag."""
    if action.nargs == 0:
        return []
    one = str(action.choices[0]) if action.choices else "1"
    return [one] * (action.nargs if isinstance(action.nargs, int) else 1)


def problem(p: FlagParser, flag: str) -> str | None:
    """What is wrong with how megart's parser treats Megatron's ``flag`` (None: nothing)."""
    action = p._option_string_actions.get(flag)
    if action is not None:  # taken: with values of its kind it parses
        if flag == "--help":
            return None
        try:
            p.parse_args([flag, *values_for(action)])
        except ConfigError as e:
            return f"{flag} is taken but did not parse: {e}"
        return None
    # Not taken: refused naming it, whether given bare, with a value or as --flag=value.
    for argv in ([flag], [flag, "1"], [f"{flag}=1"], ["--num-layers", "2", flag, "x", "y"]):
        try:
            p.parse_args(argv)
        except ConfigError as e:
            said = str(e)
            if not said.startswith(f"{flag}: ") or "unrecognized" in said or "did you mean" in said:
                return f"{argv}: {said}"
        else:
            return f"{argv} parsed"
    return None


def test_the_list_is_megatrons_whole_parser():
    names = megatron_flags()
    assert len(names) == len(set(names)) > 850  # every option string, once
    assert "d98e8a64ddf34856e74b24714e3bedb2f5a39553" in NAMES_FILE.read_text()
    # Flags registered from Megatron's config dataclasses are there too.
    assert {"--num-layers", "--moe-router-topk", "--disable-manual-gc-eval"} <= set(names)


def test_every_megatron_flag_is_taken_or_refused_by_name():
    p = parser()
    problems = [why for why in (problem(p, flag) for flag in megatron_flags()) if why]
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_dropped_refusal(monkeypatch):
    """The mutation the test above exists for: a refusal entry (single or a family) gone, the
    flag falls back to argparse's "did you mean"."""
    p = parser()
    assert problem(p, "--model-parallel-size") is None
    monkeypatch.delitem(megatron_refusals.REFUSED, "--model-parallel-size")
    assert "did you mean" in problem(p, "--model-parallel-size")
    families = [f for f in megatron_refusals.FAMILIES if "--moe-" not in f[1]]
    monkeypatch.setattr(megatron_refusals, "FAMILIES", tuple(families))
    assert "unrecognized" in problem(p, "--moe-enable-deepep")
    assert "unrecognized" in problem(p, "--expert-tensor-parallel-size")


def test_the_refusal_is_one_line_said_once(capsys):
    assert train_main(["--moe-enable-deepep", "--cache-mla-latents", "--lrr", "1"]) != 0
    err = capsys.readouterr().err
    assert err.count("megart train: error") == 1, err
    assert "--moe-enable-deepep: megart's mixture-of-experts layers" in err
    assert "--cache-mla-latents: megart's multi-latent attention" in err
    # A misspelt flag beside them is still named, with its hint.
    assert "unrecognized: --lrr (--lrr: did you mean --lr?)" in err
    assert "--num-layers" not in err


def test_flags_are_never_abbreviated():
    """As in Megatron-LM's parser: --exit-signal (Megatron's) is not --exit-signal-handler."""
    with pytest.raises(ConfigError, match="unrecognized arguments: --seq 8"):
        parser().parse_args(["--seq", "8"])
    assert parser().parse_args(["--exit-signal", "SIGTERM"]).exit_signal_handler is False


def config(*argv: str):
    return config_from_args(parser().parse_args(list(argv)))


@pytest.mark.parametrize(
    "alias, canonical",
    [
        (["--use-rotary-position-embeddings"], ["--position-embedding-type", "rope"]),
        (
            ["--use-rotary-position-embeddings", "--position-embedding-type", "rope"],
            ["--position-embedding-type", "rope"],
        ),
        (
            ["--no-position-embedding", "--position-embedding-type", "rope"],
            ["--position-embedding-type", "rope"],
        ),
        (["--disable-manual-gc-eval"], ["--no-manual-gc-eval"]),
        (["--exit-signal", "SIGTERM", "--exit-signal-handler"], ["--exit-signal-handler"]),
        (["--dataloader-type", "single", "--data-order", "megatron"], ["--data-order", "megatron"]),
        (["--use-dist-ckpt", "--dist-ckpt-format", "torch_dist"], []),
        (["--ckpt-fully-parallel-save", "--disable-msc"], []),
        (["--openai-gelu"], []),  # megart's GeLU is already the tanh form
        (
            ["--num-experts", "4", "--moe-layer-recompute"],
            ["--num-experts", "4", "--recompute-granularity", "selective",
             "--recompute-modules", "core_attn", "moe"],
        ),
        (
            ["--num-experts", "4", "--moe-layer-recompute", "--recompute-modules", "mlp"],
            ["--num-experts", "4", "--recompute-granularity", "selective",
             "--recompute-modules", "mlp", "moe"],
        ),
    ],
)  # fmt: skip
def test_an_alias_gives_its_megart_spellings_config(alias, canonical):
    assert config(*alias) == config(*canonical)
    assert config(*alias) != config() or not canonical  # the alias did something


def test_disable_is_megatrons_other_spelling_of_no():
    p = parser()
    spelt = "-use-tokenizer-model-from-checkpoint-args"
    disabled = p.parse_args(["--disable" + spelt])
    assert disabled == p.parse_args(["--no" + spelt])
    assert disabled.use_tokenizer_model_from_checkpoint_args is False


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
            "--use-rotary-position-embeddings with --position-embedding-type learned_absolute",
        ),
        (["--no-position-embedding"], "--no-position-embedding with --position-embedding-type "),
        (["--exit-signal", "SIGINT"], "--exit-signal SIGINT: megart's"),
        (["--dataloader-type", "cyclic"], "--dataloader-type cyclic: megart has"),
        (["--dataloader-type", "single"], "add --data-order megatron"),
        (
            ["--moe-layer-recompute", "--recompute-granularity", "full"],
            "--moe-layer-recompute with --recompute-granularity full",
        ),
    ],
)
def test_what_an_alias_cannot_mean_here_is_refused(argv, says):
    with pytest.raises(ConfigError, match=says):
        config(*argv)


def test_the_aliases_keep_the_defaults():
    default = config()
    assert dataclasses.replace(default) == config("--exit-signal", "SIGTERM")
    assert default.position_embedding_type == "learned_absolute"
