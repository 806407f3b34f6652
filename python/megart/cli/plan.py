"""megart plan: predicts the iteration time, TFLOP/s and memory per GPU of training a GPT on a
cluster, and recommends a layout. It takes megart train's flags (a training command line plans
unchanged); every layout flag left out is searched.

    megart plan --gpu a100-80gb --num-gpus 1024 --num-layers 96 --hidden-size 12288 \\
        --num-attention-heads 96 --seq-length 2048 --vocab-size 51200 --global-batch-size 1536
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megart.cli.train import HELP, FlagParser, add_arguments, config_from_args
from megart.errors import ConfigError, MegartError
from megart.models.stages import check_stages, uneven
from megart.training.checkpoint_args import INTERLEAVING, STAGES
from megart.training.config import TrainConfig
from megart.training.config_checks import _check_uneven as check_uneven
from megart.training.config_checks import _check_virtual_flags as check_virtual_flags
from megart.training.config_checks import (
    check_schedule_flags,
    check_two_stages,
    check_virtual_stages,
)
from megart.training.context_parallel_checks import check_context_parallel

if TYPE_CHECKING:
    from megart.plan.estimate import Estimate
    from megart.plan.hardware import GPUProfile
    from megart.plan.search import Fixed

# Layout flags megart plan searches when they are left out (the others of
# megart.plan.flags.LAYOUT are fixed when given: uneven stages, chunks per rank).
SEARCHED = (
    "micro_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "sequence_parallel",
    "recompute_granularity",
    "use_distributed_optimizer",
    "pipeline_schedule",
)
# What --use-mp-args-from-checkpoint-args takes from the checkpoint (checkpoint_args' own lists).
CHECKPOINT_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", *INTERLEAVING,
                     *STAGES)  # fmt: skip
CP_SEARCHED = (
    " (searched when left out: 1 and each power of two C with --seq-length divisible by 2 C "
    "and C dividing --num-gpus that megart train accepts (--cp-comm-type a2a: attention heads "
    "and query groups divisible by t x C); 1 only with --runtime megatron, whose exchanges the "
    "planner does not model, with --window-size under --cp-comm-type p2p, whose windowed "
    "ring blocks it does not model, and with --reset-attention-mask, which megart train "
    "refuses with context parallelism)"
)
EP_SEARCHED = (
    " (megart plan: searched when left out for a model with --num-experts: each size that "
    "divides the data-parallel size and --num-experts, at tensor- and context-parallel size 1 "
    "and without --use-distributed-optimizer, where megart train runs it; timed for balanced "
    "routing)"
)
SPANS_SEARCHED = (
    " (megart plan: kept when given, even uniform 1; with both left out and "
    "--recompute-granularity searched, a layout that fits only with full recomputation is "
    "also planned under block with the smallest N that fits)"
)
# megart train's spellings that set no TrainConfig field and change nothing planned: the
# fusions megart does not have, the only signal and sampler it has.
ALIASES_WITHOUT_EFFECT = ("fusion_off", "exit_signal", "dataloader_type")
EPILOG = (
    "Every megart train flag is taken, so that a training command line plans unchanged. Those "
    "that change neither an iteration's time nor what a GPU holds (learning rate, data, "
    "tokenizer files, checkpoints, logging, evaluation) are accepted and change nothing; those "
    "whose effect the planner does not model are refused by name unless left at megart "
    "train's default (megart.plan.flags). With neither --bf16 nor --fp16 it plans bf16 (megart "
    "train would run fp32, which the planner's figures, fitted to 16-bit runs, do not cover)."
)


def _parser() -> argparse.ArgumentParser:
    from megart.plan.flags import NO_EFFECT, UNMODELLED
    from megart.plan.hardware import GPUS
    from megart.plan.runtime_options import RUNTIMES

    p = FlagParser(
        prog="megart plan",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=EPILOG,
        conflict_handler="resolve",  # the searched switches replace megart train's below
    )
    p.add_argument("--gpu", choices=GPUS, help="a built-in cluster profile")
    p.add_argument(
        "--gpu-profile",
        metavar="FILE",
        help="a profile JSON file (copy one of megart/plan/profiles/ and edit it)",
    )
    p.add_argument("--num-gpus", type=int, required=True, help="GPUs in the job")
    add_arguments(p)  # megart train's flags, spelt and checked as there
    for name in ("sequence_parallel", "use_distributed_optimizer"):
        # Unset (None) is searched; megart train's switch would read False.
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, action="store_true", default=None, help=HELP[name])
    for action in p._actions:
        if action.dest in SEARCHED:
            action.help = f"{action.help} (searched when left out)"
        elif action.dest == "context_parallel_size":
            action.help = HELP["context_parallel_size"] + CP_SEARCHED
        elif action.dest == "expert_model_parallel_size":
            action.help = f"{action.help}{EP_SEARCHED}"
        elif action.dest in ("recompute_method", "recompute_num_layers"):
            action.help = f"{action.help}{SPANS_SEARCHED}"
        elif action.dest in UNMODELLED:
            action.help = f"{action.help} (megart plan: refused unless the default; not modelled)"
        elif action.dest in (*NO_EFFECT, *ALIASES_WITHOUT_EFFECT) or action.dest.startswith(
            "deprecated_"
        ):
            action.help = argparse.SUPPRESS  # accepted, no effect: see the epilog
    p.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="megart",
        help="whose memory conventions: megart's (default) or Megatron-LM's (16-bit weights, "
        "fp32 main weights, Korthikanti et al.'s activations; its asynchronous backward "
        "tensor-parallel collectives)",
    )
    p.add_argument("--top", type=int, default=8, help="candidates to show (default: 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--png", metavar="FILE", help="draw the candidates (needs matplotlib)")
    return p


def _base_config(args: argparse.Namespace) -> tuple[TrainConfig, TrainConfig]:
    """The command line's TrainConfig as megart train reads it (aliases, the tokenizer's
    vocabulary, --use-checkpoint-args), 16-bit compute assumed unless --fp16; refuses what the
    planner does not model, and what megart train refuses of the flags besides the layout.
    The layout flags go back to their defaults (each candidate sets its own), and so do the
    flags without effect and the tokenizer's, once their vocabulary is resolved: every
    candidate's config is made anew from this one, and would otherwise load the tokenizer
    again or count a --train-samples schedule's iterations again. Returns the config as read
    and that base."""
    from megart.plan.documents import with_end_of_document
    from megart.plan.flags import LAYOUT, NO_EFFECT, TOKENIZER, refuse_unmodelled

    # --use-checkpoint-args says what it takes, as Megatron-LM does, on stdout: here that is for
    # the table or the JSON, so those lines go to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        config = config_from_args(args)
    refuse_unmodelled(config, args.runtime)
    _check_as_megart_train(config)  # before bf16 is assumed
    if not config.fp16 and not config.bf16:
        config = dataclasses.replace(config, bf16=True)  # say --fp16 for fp16
    reset = (*LAYOUT, *NO_EFFECT, *TOKENIZER)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in reset}
    return config, with_end_of_document(dataclasses.replace(config, **defaults))


def _check_as_megart_train(config: TrainConfig) -> None:
    """megart train's refusals of the flags other than the layout's, in its words: its checks
    of the command line's config as on one process, the layout flags (each candidate's own,
    checked with it) at values every model runs with. The distributed optimizer stays on
    unless refused: searched, it is there for --overlap-param-gather, which needs it."""
    from megart.plan.flags import LAYOUT

    neutral = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in LAYOUT}
    del neutral["recompute_granularity"], neutral["recompute_activations"]  # as given
    neutral["use_distributed_optimizer"] = config.use_distributed_optimizer is not False
    neutral["micro_batch_size"] = 1  # any global batch splits into microbatches of 1
    dataclasses.replace(config, **neutral).check(1)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(_parser().parse_args(argv))
    except MegartError as e:
        print(f"megart plan: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from megart.plan.hardware import load_profile

    gpu = load_profile(args.gpu, args.gpu_profile)
    if args.num_gpus < 1:
        raise ConfigError(f"--num-gpus {args.num_gpus} must be at least 1")
    config, base = _base_config(args)
    found = _search(args, base, gpu, _fixed(args, config, base))
    _report(args, found, gpu)
    return 0


def _fixed(args: argparse.Namespace, config: TrainConfig, base: TrainConfig) -> Fixed:
    """The layout the command line fixes (None where searched), refused in megart train's
    words where megart train would refuse it."""
    from megart.plan.search import Fixed

    lay = _given_layout(args, config)
    check_schedule_flags(lay.pipeline_schedule, lay.num_layers_per_virtual_pipeline_stage)
    _check_context_parallel(lay, base)
    chunks = _chunks(lay, base)
    if chunks is None and _from_checkpoint(args):
        chunks = config.chunks  # the checkpoint's, 1 when it was not interleaved
    # Megatron's --recompute-activations is --recompute-granularity selective, whatever that
    # flag says (model_flags).
    recompute = "selective" if lay.recompute_activations else lay.recompute_granularity or False
    return Fixed(
        tp=lay.tensor_model_parallel_size,
        pp=lay.pipeline_model_parallel_size,
        chunks=chunks,
        micro_batch=lay.micro_batch_size,
        sequence_parallel=lay.sequence_parallel,
        recompute=recompute,
        distributed_optimizer=lay.use_distributed_optimizer,
        # A given --num-layers-per-virtual-pipeline-stage is the interleaved schedule to
        # megart train, even at one chunk a rank (its microbatches a multiple of the stages).
        schedule=lay.pipeline_schedule
        or ("interleaved" if lay.num_layers_per_virtual_pipeline_stage is not None else None),
        first=lay.decoder_first_pipeline_num_layers,
        last=lay.decoder_last_pipeline_num_layers,
        cp=lay.context_parallel_size,
        ep=lay.expert_model_parallel_size,
        # Given, even at megart train's defaults (Megatron's uniform 1 spelt out): kept, not
        # searched. Left out, megart train's parser leaves them unset (SUPPRESS).
        spans=any(hasattr(args, n) for n in ("recompute_method", "recompute_num_layers")),
        chunks_by_count=lay.num_virtual_stages_per_pipeline_rank is not None,
    )


def _from_checkpoint(args: argparse.Namespace) -> bool:
    """Whether the layout is the checkpoint's (--use-mp-args-from-checkpoint-args)."""
    return getattr(args, "use_mp_args_from_checkpoint_args", False)


def _given_layout(args: argparse.Namespace, config: TrainConfig) -> argparse.Namespace:
    """The layout flags given (None: searched); megart train's parser leaves out the others."""
    from megart.plan.flags import LAYOUT

    lay = argparse.Namespace(**{n: getattr(args, n, None) for n in LAYOUT})
    if _from_checkpoint(args):
        # Megatron's: the checkpoint's tensor and pipeline sizes, interleaving and uneven
        # stages are the run's (megart.training.checkpoint_args), so they are not searched.
        for name in CHECKPOINT_LAYOUT:
            setattr(lay, name, getattr(config, name))
    # 0 is not "searched": sizes given must be at least 1 (megart train refuses them too).
    for name in ("micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = getattr(lay, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be at least 1")
    return lay


def _check_context_parallel(lay: argparse.Namespace, base: TrainConfig) -> None:
    """Refuses a context-parallel size given that megart train would refuse."""
    cp = lay.context_parallel_size  # None: searched
    # megart train's refusals of context parallelism, in its words: a size below 1, a
    # sequence that does not split into 2 cp chunks (nor s/cp over t with --sequence-parallel).
    check_context_parallel(
        dataclasses.replace(
            base,
            context_parallel_size=1 if cp is None else cp,
            sequence_parallel=bool(lay.sequence_parallel),
            pipeline_schedule=lay.pipeline_schedule,
        ),
    )


def _chunks(lay: argparse.Namespace, base: TrainConfig) -> int | None:
    """Model chunks per pipeline rank that the stage flags given fix (None: searched), after
    megart train's checks of those flags; they need --pipeline-model-parallel-size."""
    first, last = lay.decoder_first_pipeline_num_layers, lay.decoder_last_pipeline_num_layers
    virtual = lay.num_virtual_stages_per_pipeline_rank
    per = lay.num_layers_per_virtual_pipeline_stage
    pp = lay.pipeline_model_parallel_size
    chunks = None
    if uneven(first, last) or virtual is not None:
        if pp is None:
            given = [f"--{n.replace('_', '-')}" for n in STAGES if getattr(lay, n)]
            given += ["--num-virtual-stages-per-pipeline-rank"] if virtual is not None else []
            raise ConfigError(f"{' and '.join(given)} need --pipeline-model-parallel-size")
        # megart train's refusals, in its words.
        probe = dataclasses.replace(
            base,
            pipeline_model_parallel_size=pp,
            pipeline_schedule=lay.pipeline_schedule,
            num_layers_per_virtual_pipeline_stage=per,
            num_virtual_stages_per_pipeline_rank=virtual,
            decoder_first_pipeline_num_layers=first,
            decoder_last_pipeline_num_layers=last,
        )
        check_virtual_flags(probe)
        check_uneven(probe)
        check_stages(base.num_layers, pp, probe.chunks, first, last)
        chunks = virtual
    if per is not None:
        if pp is None:
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size"
            )
        check_two_stages("--num-layers-per-virtual-pipeline-stage", pp)  # as megart train
        check_virtual_stages(base.num_layers, pp, per)
        chunks = base.num_layers // (pp * per)
    return chunks


def _search(
    args: argparse.Namespace, base: TrainConfig, gpu: GPUProfile, fixed: Fixed
) -> list[Estimate]:
    """The best layouts, fastest first; where none fits, --png still draws the candidates
    before the error says how much memory is missing."""
    from megart.plan.search import NoFit, search

    try:
        return search(base, args.num_gpus, gpu, fixed, keep=max(1, args.top), runtime=args.runtime)
    except NoFit as e:
        if args.png:
            _draw(e.estimates, gpu, args.png)
        raise


def _report(args: argparse.Namespace, found: list[Estimate], gpu: GPUProfile) -> None:
    """--png's drawing, then the table or --json's object on stdout."""
    from megart.plan.report import plan_json, table

    if args.png:
        _draw(found, gpu, args.png)
    if args.json:
        print(json.dumps(plan_json(found, gpu, args.num_gpus), indent=1))
    else:
        print(table(found, gpu, args.num_gpus))


def _draw(found: list[Estimate], gpu: GPUProfile, path: str) -> None:
    """--png's drawing; a path it cannot write (no such folder, no permission, a suffix
    matplotlib has no format for) is refused naming it."""
    from megart.plan.report import draw

    try:
        draw(found, gpu, path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--png {path}: cannot write it ({e}); give a writable .png path") from e
