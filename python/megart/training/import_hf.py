"""A Hugging Face GPT-2 or Llama directory as a megart checkpoint, to fine-tune under any
layout.

    import_checkpoint("gpt2-dir", "ckpt")  # megart import-hf --input gpt2-dir --save ckpt
    # then: megart train --load ckpt --vocab-size 50257 --num-layers 12 ... (any tp x pp)

The checkpoint is what Megatron calls a release checkpoint: the weights alone, in one
tensor- and pipeline-parallel rank's file, marked ``release``. ``--load`` of it loads the
weights only and starts at iteration 0 (as ``--finetune``), resharded to the run's layout like
any checkpoint of another layout (megart.training.reshard).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from megart.errors import ConfigError
from megart.models import GPT
from megart.training.checkpoint import write_release


def import_checkpoint(
    input_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    seq_length: int | None = None,
    apply_layernorm_1p: bool = False,
) -> Path:
    """Writes the GPT-2 or Llama in ``input_dir`` (transformers' save_pretrained files) as a
    release checkpoint in ``save_dir``; returns its file. ``seq_length`` is the length to
    train with: a GPT-2 keeps that many of its learned positions (default all, n_positions);
    a Llama's rotary positions have no table, so any length is the same weights (default its
    max_position_embeddings). ``apply_layernorm_1p`` writes a model for ``megart train
    --apply-layernorm-1p``: the same network, its norm weights stored zero-centred (the
    file's minus 1)."""
    model = GPT.from_hf(str(input_dir))
    cfg, weights = model.cfg, model.chunk.state_dict()
    if apply_layernorm_1p:
        # A checkpoint records its model's flags and train --load refuses another model's, so
        # the choice is made here, once, for the stored weights.
        cfg = dataclasses.replace(cfg, apply_layernorm_1p=True)
        norms = ("ln_1.weight", "ln_2.weight", "ln_f.weight")
        weights.update({k: w - 1 for k, w in weights.items() if k.endswith(norms)})
    if seq_length is not None and seq_length != cfg.seq_length:
        learned = "wpe.weight" in weights
        if seq_length < 1 or (learned and seq_length > cfg.seq_length):
            what = f"{cfg.seq_length} learned positions" if learned else "rotary positions"
            limit = f"1 to {cfg.seq_length}" if learned else "a positive length"
            raise ConfigError(f"--seq-length {seq_length}: {input_dir} has {what}; give {limit}")
        cfg = dataclasses.replace(cfg, seq_length=seq_length)
        if learned:
            # Position p's embedding does not depend on how many follow it: the first rows
            # are the model for shorter sequences.
            weights["wpe.weight"] = weights["wpe.weight"][:seq_length].clone()
    return write_release(save_dir, cfg, weights, list(model.chunk.layer_ids))
