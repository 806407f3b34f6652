"""megart import-hf: a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3 or Nemotron directory as
a megart checkpoint.

    megart import-hf --input HF_DIR --save CHECKPOINT_DIR [--seq-length N]
        [--apply-layernorm-1p] [--target-tensor-parallel-size T]
        [--target-pipeline-parallel-size P]

HF_DIR is a save_pretrained directory of GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM or NemotronForCausalLM (config.json's model_type says which;
safetensors weights; a Nemotron trains with --squared-relu --apply-layernorm-1p
--position-embedding-type rope --rotary-percent (its partial_rotary_factor);
a Qwen3 is a Llama that trains with --qk-layernorm too, a Qwen2 one with --disable-bias-linear
--add-qkv-bias; a sliding window W, a Mistral's or on a Qwen2's or Qwen3's sliding layers,
trains with --window-size W-1,0, and --window-attn-skip-freq where only some layers have it). A
Llama trains with --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights (unless its config ties them) --disable-bias-linear
(unless it has biases) and, with fewer key/value heads than heads, --group-query-attention
--num-query-groups; the checkpoint records them, and
``megart train --load`` names any that differ.

CHECKPOINT_DIR then holds a release checkpoint (the weights alone) that ``megart train --load
CHECKPOINT_DIR`` loads under any tensor- and pipeline-parallel layout, starting at iteration 0.
With --target-tensor-parallel-size / --target-pipeline-parallel-size (the names of Megatron's
converter) it is written as the files of that layout, one pipeline stage at a time: the import
then holds one stage's weights, not the whole model, and a run of that layout reads only its
own files.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megart.cli.hf_common import run_conversion


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megart import-hf", description=__doc__.splitlines()[0])
    p.add_argument(
        "--input",
        required=True,
        metavar="DIR",
        help="a GPT-2, Llama, Mistral, Qwen2, Qwen3 or Nemotron directory (save_pretrained files)",
    )
    p.add_argument("--save", required=True, metavar="DIR", help="where to write the checkpoint")
    p.add_argument(
        "--seq-length",
        type=int,
        metavar="N",
        help="the sequence length to train with: a GPT-2 keeps its first N learned positions "
        "(default: all, n_positions); a Llama's rotary positions take any N (default: "
        "max_position_embeddings)",
    )
    p.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="store the norm weights zero-centred (the file's minus 1), for megart train "
        "--apply-layernorm-1p: the same network",
    )
    for dim in ("tensor", "pipeline"):
        p.add_argument(
            f"--target-{dim}-parallel-size",
            type=int,
            default=1,
            metavar="N",
            help=f"write the checkpoint as the files of {dim}-parallel size N (default 1); any "
            "layout loads it, this one without resharding",
        )
    args = p.parse_args(argv)

    def convert() -> str:
        from megart.training.import_hf import import_for_training

        return import_for_training(
            args.input,
            args.save,
            args.seq_length,
            args.apply_layernorm_1p,
            tp=args.target_tensor_parallel_size,
            pp=args.target_pipeline_parallel_size,
        )

    return run_conversion("megart import-hf", convert)
