"""megart convert-checkpoint: between megart checkpoints, Megatron-LM's checkpoints (legacy,
``--ckpt-format torch``, or distributed, ``torch_dist``) and Hugging Face directories (GPT-2's or
Llama's format, by the model's architecture), in one process.

    megart convert-checkpoint --from megart --to megatron --load CKPT --save OUT \
        [--ckpt-format torch_dist] \
        [--target-tensor-parallel-size T --target-pipeline-parallel-size P] \
        [--target-decoder-first-pipeline-num-layers F] \
        [--target-decoder-last-pipeline-num-layers L] \
        [--target-num-virtual-stages-per-pipeline-rank V]
    megart convert-checkpoint --from megatron --to megart --load MEGATRON_CKPT --save OUT
    megart convert-checkpoint --from megatron --to hf --load MEGATRON_CKPT --save HF_DIR \
        [--dtype bfloat16] [--max-shard-size 5GB] [--tokenizer-model NAME_OR_DIR]
    megart convert-checkpoint --from hf --to megatron --load HF_DIR --save OUT \
        [--ckpt-format torch_dist] \
        [--target-tensor-parallel-size T --target-pipeline-parallel-size P] \
        [--target-decoder-first-pipeline-num-layers F] \
        [--target-decoder-last-pipeline-num-layers L] \
        [--target-num-virtual-stages-per-pipeline-rank V]
    megart convert-checkpoint --from hf --to megart --load HF_DIR --save OUT \
        [--target-tensor-parallel-size T --target-pipeline-parallel-size P]

A Hugging Face directory (GPT-2's or Llama's, save_pretrained files) goes through a megart
release checkpoint (megart import-hf), so --from hf --to megart is import-hf itself. With
--to megatron, --target-decoder-first/last-pipeline-num-layers give the checkpoint written
uneven first/last pipeline stages (Megatron-LM's --decoder-first/last-pipeline-num-layers,
checked as megart train checks those); without them a megart source's split is kept unless
--target-pipeline-parallel-size or --target-tensor-parallel-size is given (then even).
--target-num-virtual-stages-per-pipeline-rank V writes V model chunks per pipeline rank, the
files of Megatron-LM's interleaved schedule (its --num-virtual-stages-per-pipeline-rank; by
default the source's interleaving is kept).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from megart.cli.hf_common import run_conversion
from megart.errors import ConfigError

# export_checkpoint's options for --to hf, by their flags.
HF_FLAGS = {
    "dtype": "--dtype",
    "max_shard_size": "--max-shard-size",
    "tokenizer_model": "--tokenizer-model",
    "recorded_tokenizer": "--no-tokenizer",
}
TARGET_FIRST = "--target-decoder-first-pipeline-num-layers"
TARGET_LAST = "--target-decoder-last-pipeline-num-layers"
TARGET_VPP = "--target-num-virtual-stages-per-pipeline-rank"


def convert(
    source: str,
    target: str,
    load: str,
    save: str,
    tp: int | None = None,
    pp: int | None = None,
    ckpt_format: str = "torch",
    hf_options: dict[str, str] | None = None,
    first: int | None = None,
    last: int | None = None,
    vpp: int | None = None,
) -> str:
    """Converts the latest checkpoint in ``load`` (or the Hugging Face directory ``load``);
    returns what was written. ``tp`` and ``pp``: the layout of a Megatron-LM checkpoint
    written (by default the source's); ``ckpt_format``: its format (a Megatron-LM checkpoint
    read is either); ``hf_options``: export_checkpoint's dtype, max_shard_size and
    tokenizer_model for a Hugging Face directory written; ``first``/``last``: the uneven
    first/last pipeline stages of a Megatron-LM checkpoint written; ``vpp``: its model chunks
    per pipeline rank (Megatron-LM's interleaving)."""
    hf_options = hf_options or {}
    tokenizer = hf_options.get("tokenizer_model")
    from megart.training.export_hf import describe, export_checkpoint
    from megart.training.import_hf import import_checkpoint, import_for_training
    from megart.training.megatron_checkpoint import megart_to_megatron, megatron_to_megart

    if source == target:
        raise ConfigError(f"--from {source} --to {target}: nothing to convert")
    layout_written = target == "megatron" or (source, target) == ("hf", "megart")
    if (tp is not None or pp is not None) and not layout_written:
        raise ConfigError(
            "--target-tensor-parallel-size and --target-pipeline-parallel-size set the layout "
            "of a Megatron-LM checkpoint written, or of an imported one (--from hf --to "
            "megart): use them there only"
        )
    stages = {TARGET_FIRST: first, TARGET_LAST: last, TARGET_VPP: vpp}
    if target != "megatron" and any(n is not None for n in stages.values()):
        flags = " and ".join(flag for flag, n in stages.items() if n is not None)
        raise ConfigError(
            f"{flags} set the pipeline stages of a Megatron-LM checkpoint written: use "
            "them with --to megatron only"
        )
    if ckpt_format != "torch" and target != "megatron":
        raise ConfigError(
            f"--ckpt-format {ckpt_format} sets the format of a Megatron-LM checkpoint written: "
            "use it with --to megatron only (a Megatron-LM checkpoint read may be either)"
        )
    if hf_options and target != "hf":
        flags = ", ".join(HF_FLAGS[k] for k in hf_options)
        raise ConfigError(
            f"{flags} set how a Hugging Face directory is written: use them with --to hf only"
        )
    if tokenizer is not None and hf_options.get("recorded_tokenizer") is False:
        raise ConfigError("--tokenizer-model and --no-tokenizer: give one or the other")
    if source == "hf" and target == "megatron":
        with tempfile.TemporaryDirectory() as tmp:  # hf -> megart -> megatron
            import_checkpoint(load, tmp)
            files = megart_to_megatron(tmp, save, tp, pp, ckpt_format, first, last, vpp)
            return _megatron_files(files, ckpt_format)
    if source == "hf":
        return import_for_training(
            load, save, tp=1 if tp is None else tp, pp=1 if pp is None else pp
        )
    if source == "megart" and target == "megatron":
        files = megart_to_megatron(load, save, tp, pp, ckpt_format, first, last, vpp)
        return _megatron_files(files, ckpt_format)
    if source == "megart":
        return describe(export_checkpoint(load, save, **hf_options), tokenizer)
    if target == "megart":
        return f"{megatron_to_megart(load, save)} (megart release checkpoint)"
    # Merged in memory, as --to megart merges it (no release checkpoint written on the way).
    return describe(export_checkpoint(load, save, megatron=True, **hf_options), tokenizer)


def _megatron_files(files: list[Path], ckpt_format: str) -> str:
    if ckpt_format == "torch_dist":
        return f"{files[0]}: Megatron-LM torch_dist checkpoint (weights)"
    return f"{files[0].parents[1]}: {len(files)} rank files (Megatron-LM legacy, weights)"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megart convert-checkpoint", description=__doc__.splitlines()[0]
    )
    p.add_argument("--from", dest="source", required=True, choices=("megart", "megatron", "hf"))
    p.add_argument("--to", dest="target", required=True, choices=("megart", "megatron", "hf"))
    p.add_argument(
        "--load", required=True, metavar="DIR", help="the checkpoint (or Hugging Face) directory"
    )
    p.add_argument("--save", required=True, metavar="DIR", help="where to write")
    for what in ("tensor", "pipeline"):
        p.add_argument(
            f"--target-{what}-parallel-size",
            type=int,
            metavar="N",
            help=f"--to megatron: the {what}-parallel size of the checkpoint written "
            "(default: the source checkpoint's layout); --from hf --to megart: as import-hf's",
        )
    for flag, end in ((TARGET_FIRST, "first"), (TARGET_LAST, "last")):
        p.add_argument(
            flag,
            type=int,
            metavar="N",
            help=f"--to megatron: the layers of the {end} pipeline stage of the checkpoint "
            f"written, as Megatron-LM's --decoder-{end}-pipeline-num-layers (the other stages "
            "share the rest evenly; default: the source's split, or even with "
            "--target-*-parallel-size); torch_dist records it in args",
        )
    p.add_argument(
        TARGET_VPP,
        type=int,
        metavar="V",
        help="--to megatron: the model chunks of each pipeline rank of the checkpoint written, "
        "as Megatron-LM's --num-virtual-stages-per-pipeline-rank (its interleaved schedule's "
        "files; default: the source's)",
    )
    p.add_argument(
        "--ckpt-format",
        choices=("torch", "torch_dist"),
        default="torch",
        help="--to megatron: Megatron-LM's legacy format (torch, the default here) or its "
        "distributed one (torch_dist, Megatron-LM's default)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="--to hf: the weights' type in the files (default float32), as export-hf's",
    )
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="--to hf: the largest weight file (default 5GB), as export-hf's",
    )
    p.add_argument(
        "--tokenizer-model",
        metavar="NAME_OR_DIR",
        help="--to hf: a Hugging Face tokenizer to save beside the weights, as export-hf's",
    )
    p.add_argument(
        "--no-tokenizer",
        dest="recorded_tokenizer",
        action="store_const",
        const=False,
        help="--to hf: save no tokenizer, not even the one the checkpoint records",
    )
    args = p.parse_args(argv)
    hf_options = {k: getattr(args, k) for k in HF_FLAGS if getattr(args, k) is not None}
    return run_conversion(
        "megart convert-checkpoint",
        lambda: convert(
            args.source,
            args.target,
            args.load,
            args.save,
            args.target_tensor_parallel_size,
            args.target_pipeline_parallel_size,
            args.ckpt_format,
            hf_options,
            args.target_decoder_first_pipeline_num_layers,
            args.target_decoder_last_pipeline_num_layers,
            args.target_num_virtual_stages_per_pipeline_rank,
        ),
    )
