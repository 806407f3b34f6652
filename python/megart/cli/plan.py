"""megart plan: predicts the iteration time, TFLOP/s and memory per GPU of training a GPT on a
cluster, and recommends a layout. The model flags are megart train's; every layout flag left out
is searched.

    megart plan --gpu a100-80gb --num-gpus 1024 --num-layers 96 --hidden-size 12288 \\
        --num-attention-heads 96 --seq-length 2048 --vocab-size 51200 --global-batch-size 1536
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from megart.cli.train import HELP
from megart.errors import MegartError
from megart.models.stages import check_stages, uneven
from megart.training.config import CHOICES, TrainConfig
from megart.training.config_checks import _check_uneven as check_uneven
from megart.training.config_checks import _check_virtual_flags as check_virtual_flags
from megart.training.config_checks import check_schedule_flags, check_virtual_stages
from megart.training.context_parallel_checks import check_context_parallel

MODEL_FLAGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
    "ffn_hidden_size",
    "normalization",
    "position_embedding_type",
    "swiglu",
    "disable_bias_linear",
    "untie_embeddings_and_output_weights",
    "group_query_attention",
    "num_query_groups",
    "qk_layernorm",
    "rotary_percent",
    "hidden_dropout",
    "global_batch_size",
    "fp16",
    "bf16",
    "fp32_residual_connection",
    "half_weights",
    "cp_comm_type",  # how context parallelism's K/V travel: p2p (default), all_gather or a2a
)
# Layout flags: given, they are fixed; left out, searched.
LAYOUT_FLAGS = (
    "micro_batch_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "sequence_parallel",
    "recompute_granularity",
    "use_distributed_optimizer",
    "pipeline_schedule",
)


# megart train's uneven pipeline stages: given, each rank's layers set its stage's costs and
# memory (never searched; they need --pipeline-model-parallel-size).
UNEVEN_FLAGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
# megart train's context parallelism: each sequence split over that many ranks (world =
# t x cp x d x p); searched when left out.
CP_FLAG = "context_parallel_size"
CP_SEARCHED = (
    " (searched when left out: 1 and each power of two C with --seq-length divisible by 2 C "
    "and C dividing --num-gpus that megart train accepts (--cp-comm-type a2a: attention heads "
    "and query groups divisible by t x C); 1 only with --runtime megatron, whose exchanges the "
    "planner does not model)"
)


def _parser() -> argparse.ArgumentParser:
    from megart.plan.estimate import RUNTIMES
    from megart.plan.hardware import GPUS

    p = argparse.ArgumentParser(
        prog="megart plan", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    p.add_argument("--gpu", choices=GPUS, help="a built-in cluster profile")
    p.add_argument(
        "--gpu-profile",
        metavar="FILE",
        help="a profile JSON file (copy one of megart/plan/profiles/ and edit it)",
    )
    p.add_argument("--num-gpus", type=int, required=True, help="GPUs in the job")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in MODEL_FLAGS + LAYOUT_FLAGS:
        f = fields[name]
        flag = "--" + name.replace("_", "-")
        text = HELP[name] + (" (searched when left out)" if name in LAYOUT_FLAGS else "")
        if f.type in ("bool", bool):
            default = None if name in LAYOUT_FLAGS else False
            p.add_argument(flag, dest=name, action="store_true", default=default, help=text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            choices = CHOICES.get(name) or (("full", "selective") if "recompute" in name else None)
            p.add_argument(flag, dest=name, type=kind, default=None, choices=choices, help=text)
    for name in (*UNEVEN_FLAGS, CP_FLAG):
        text = HELP[name] + (CP_SEARCHED if name == CP_FLAG else "")
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, help=text)
    p.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="megart",
        help="whose memory conventions: megart's (default) or Megatron-LM's (16-bit weights, "
        "fp32 main weights, Korthikanti et al.'s activations)",
    )
    p.add_argument("--top", type=int, default=8, help="candidates to show (default: 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--png", metavar="FILE", help="draw the candidates (needs matplotlib)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except MegartError as e:
        print(f"megart plan: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from megart.errors import ConfigError
    from megart.plan.hardware import load_profile
    from megart.plan.report import draw, plan_json, table
    from megart.plan.search import Fixed, NoFit, search

    gpu = load_profile(args.gpu, args.gpu_profile)
    world = args.num_gpus
    if world < 1:
        raise ConfigError(f"--num-gpus {world} must be at least 1")
    # "is": a switch left out is False, but --hidden-dropout 0 (== False) is a value given.
    given = {n: v for n in MODEL_FLAGS if (v := getattr(args, n)) is not None and v is not False}
    if not args.fp16 and not args.bf16:
        given["bf16"] = True  # 16-bit compute is assumed; say --fp16 for fp16
    base = TrainConfig(**given)
    chunks = None
    per = args.num_layers_per_virtual_pipeline_stage
    check_schedule_flags(args.pipeline_schedule, per)  # megart train's refusals
    cp = args.context_parallel_size  # None: searched
    # megart train's refusals of context parallelism, in its words: a size below 1, a
    # sequence that does not split into 2 cp chunks (nor s/cp over t with --sequence-parallel).
    check_context_parallel(
        dataclasses.replace(
            base,
            context_parallel_size=1 if cp is None else cp,
            sequence_parallel=bool(args.sequence_parallel),
            pipeline_schedule=args.pipeline_schedule,
        )
    )
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    virtual = args.num_virtual_stages_per_pipeline_rank
    if uneven(first, last) or virtual is not None:
        pp = args.pipeline_model_parallel_size
        if pp is None:
            given = [f"--{n.replace('_', '-')}" for n in UNEVEN_FLAGS if getattr(args, n)]
            given += ["--num-virtual-stages-per-pipeline-rank"] if virtual is not None else []
            raise ConfigError(f"{' and '.join(given)} need --pipeline-model-parallel-size")
        # megart train's refusals, in its words.
        probe = dataclasses.replace(
            base,
            pipeline_model_parallel_size=pp,
            pipeline_schedule=args.pipeline_schedule,
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
        pp = args.pipeline_model_parallel_size
        if pp is None:
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size"
            )
        check_virtual_stages(base.num_layers, pp, per)
        chunks = base.num_layers // (pp * per)
    fixed = Fixed(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        chunks=chunks,
        micro_batch=args.micro_batch_size,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute_granularity or False,
        distributed_optimizer=args.use_distributed_optimizer,
        schedule=args.pipeline_schedule,
        first=first,
        last=last,
        cp=cp,
    )
    try:
        found = search(base, world, gpu, fixed, keep=max(1, args.top), runtime=args.runtime)
    except NoFit as e:
        if args.png:
            draw(e.estimates, gpu, args.png)
        raise
    if args.png:
        draw(found, gpu, args.png)
    if args.json:
        print(json.dumps(plan_json(found, gpu, world), indent=1))
    else:
        print(table(found, gpu, world))
    return 0
