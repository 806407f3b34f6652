"""The ``megart`` command: ``megart COMMAND ...`` (also ``python -m megart COMMAND ...``).

Commands live in one registry, ``COMMANDS``: each names the module whose ``main(argv)`` runs it
and one line of help, so ``megart --help`` lists every command there is."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # holds main(argv: Sequence[str]) -> int
    summary: str  # one line for ``megart --help``


COMMANDS: dict[str, Command] = {
    "train": Command(
        "megart.cli.train", "train GPT with Megatron-LM's flags (torchrun for more ranks)"
    ),
    "preprocess-data": Command(
        "megart.cli.preprocess", "turn text or JSONL into a Megatron indexed dataset (.bin/.idx)"
    ),
    "export-hf": Command(
        "megart.cli.export_hf",
        "write a megart checkpoint as a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3 or "
        "Nemotron model",
    ),
    "import-hf": Command(
        "megart.cli.import_hf",
        "turn a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3 or Nemotron model into a megart "
        "checkpoint",
    ),
    "convert-checkpoint": Command(
        "megart.cli.convert", "convert checkpoints between megart, Megatron-LM and Hugging Face"
    ),
    "plan": Command(
        "megart.cli.plan", "predict time, TFLOP/s and memory of layouts on a cluster; recommend one"
    ),
    "selftest": Command(
        "megart.cli.selftest", "check every component megart would use on this machine (GPUs too)"
    ),
}

HELP_WORDS = ("-h", "--help", "help")


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: megart COMMAND [--help] [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "Run 'megart COMMAND --help' for a command's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in HELP_WORDS:
        # `megart help train` is `megart train --help`.
        if len(argv) > 1 and argv[0] == "help" and argv[1] in COMMANDS:
            return main([argv[1], "--help"])
        print(usage())
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"megart: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return importlib.import_module(command.module).main(argv[1:])
