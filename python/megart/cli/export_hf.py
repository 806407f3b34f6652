"""megart export-hf: a training checkpoint to a Hugging Face directory, in one process.

The checkpoint may come from any tensor- and pipeline-parallel layout (interleaved too) and
any --ckpt-format megart train writes (megart, torch, torch_dist): its files are merged here,
with no launcher and no process group.

    megart export-hf --load CHECKPOINT_DIR --output HF_DIR [--iteration N]
        [--dtype {float32,bfloat16,float16}] [--max-shard-size 5GB]
        [--tokenizer-model NAME_OR_DIR | --no-tokenizer]

HF_DIR then holds config.json and model.safetensors (or numbered files and their index, as
save_pretrained shards a model larger than --max-shard-size) in GPT-2's format (a model of GPT-2's
architecture: ``transformers.GPT2LMHeadModel.from_pretrained(HF_DIR)``) or Llama's (one with
RMSNorm, rotary positions and SwiGLU: ``LlamaForCausalLM``) or Qwen3's (such a model with
--qk-layernorm and no linear biases: ``Qwen3ForCausalLM``) or Qwen2's (such a model with
--disable-bias-linear --add-qkv-bias, biases on q/k/v alone: ``Qwen2ForCausalLM``); a
Llama-style model with --window-size LEFT,0 in every layer and no biases is written as a Mistral
(``MistralForCausalLM``, sliding_window LEFT + 1), a Qwen3 or Qwen2 one with its windowed layers
in layer_types; a model with --squared-relu, --apply-layernorm-1p and rope (LayerNorm, unscaled,
halves) in Nemotron's (``NemotronForCausalLM``, partial_rotary_factor its --rotary-percent);
megart's ``GPT.from_hf(HF_DIR)`` loads each. A model no format can represent is
refused, naming the flags. The tokenizer the model was trained with (megart train's
--tokenizer-model, or --vocab-file and --merge-file; import-hf's directory's own), which the
checkpoint records, is saved beside the weights, or the one --tokenizer-model names.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megart.cli.hf_common import run_conversion


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megart export-hf", description=__doc__.splitlines()[0])
    p.add_argument(
        "--load", required=True, metavar="DIR", help="a directory that megart train --save wrote"
    )
    p.add_argument(
        "--output", required=True, metavar="DIR", help="where to write the Hugging Face files"
    )
    p.add_argument(
        "--iteration", type=int, metavar="N", help="the checkpoint to export (default: latest)"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the weights' type in the files (default: float32, as trained)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="the largest weight file, as transformers' save_pretrained takes it (5GB, 500MB, "
        "2GiB; default 5GB); a larger model is written in numbered files with an index",
    )
    p.add_argument(
        "--tokenizer-model",
        metavar="NAME_OR_DIR",
        help="a Hugging Face tokenizer (directory, or name in the local cache) to save beside "
        "the weights, as megart train's --tokenizer-model takes it: the directory then "
        "generates text as it is (default: the tokenizer the checkpoint records, if any)",
    )
    p.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="save no tokenizer, not even the one the checkpoint records",
    )
    args = p.parse_args(argv)
    if args.no_tokenizer and args.tokenizer_model:
        p.error("--tokenizer-model and --no-tokenizer: give one or the other")

    def convert() -> str:
        from megart.training.export_hf import describe, export_checkpoint

        out = export_checkpoint(
            args.load,
            args.output,
            args.iteration,
            args.dtype,
            args.max_shard_size,
            args.tokenizer_model,
            recorded_tokenizer=not args.no_tokenizer,
        )
        return describe(out, args.tokenizer_model)

    return run_conversion("megart export-hf", convert)
