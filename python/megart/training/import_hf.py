"""A Hugging Face GPT-2 or Llama directory as a megart checkpoint, to fine-tune under any
layout.

    import_checkpoint("gpt2-dir", "ckpt")  # megart import-hf --input gpt2-dir --save ckpt
    # then: megart train --load ckpt --vocab-size 50257 --num-layers 12 ... (any tp x pp),
    # the model's flags as train_flags gives them (import-hf prints them)

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
from megart.models import GPT, GPTConfig
from megart.models.config import MEGATRON_NORMS, MEGATRON_POSITIONS
from megart.training.checkpoint import write_release
from megart.training.megatron_args import integral


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
    return _imported(input_dir, save_dir, seq_length, apply_layernorm_1p)[0]


def import_for_training(
    input_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    seq_length: int | None = None,
    apply_layernorm_1p: bool = False,
) -> str:
    """import_checkpoint, then what import-hf prints: the release checkpoint written and the
    megart train flags that load it."""
    release_file, cfg = _imported(input_dir, save_dir, seq_length, apply_layernorm_1p)
    flags = " ".join(train_flags(cfg))
    return f"{release_file}: release checkpoint; train with --load {save_dir} {flags}"


def _imported(
    input_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    seq_length: int | None,
    apply_layernorm_1p: bool,
) -> tuple[Path, GPTConfig]:
    """(the release file written, the model's GPTConfig as recorded in it)."""
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
    return write_release(save_dir, cfg, weights, list(model.chunk.layer_ids)), cfg


def train_flags(cfg: GPTConfig) -> list[str]:
    """The ``megart train`` arguments (Megatron-LM's flags, as an argv list) that build
    ``cfg``'s model, so that ``--load`` of its checkpoint finds the model it was saved with:
    sizes, then architecture."""

    flags = [
        f"--num-layers {cfg.num_layers}",
        f"--hidden-size {cfg.hidden_size}",
        f"--num-attention-heads {cfg.num_attention_heads}",
        f"--ffn-hidden-size {cfg.ffn_size}",
        f"--seq-length {cfg.seq_length}",
        f"--vocab-size {cfg.vocab_size}",
        f"--normalization {MEGATRON_NORMS[cfg.normalization]}",
        f"--layernorm-epsilon {cfg.layernorm_epsilon!r}",
        f"--position-embedding-type {MEGATRON_POSITIONS[cfg.position_embedding]}",
    ]
    switches = {
        "--apply-layernorm-1p": cfg.apply_layernorm_1p,
        "--swiglu": cfg.activation == "swiglu",
        "--disable-bias-linear": not cfg.bias,
        "--untie-embeddings-and-output-weights": cfg.untie_embeddings_and_output_weights,
    }
    flags += [flag for flag, on in switches.items() if on]
    if cfg.query_groups != cfg.num_attention_heads:
        flags.append(f"--group-query-attention --num-query-groups {cfg.query_groups}")
    if cfg.position_embedding == "rotary":
        flags.append(f"--rotary-base {integral(cfg.rotary_base)}")
        if cfg.rotary_interleaved:
            flags.append("--rotary-interleaved")
        if cfg.rope_scaling:
            flags.append(f"--use-rope-scaling --rope-scaling-factor {cfg.rope_scaling_factor!r}")
        if cfg.rotary_seq_len_interpolation_factor is not None:
            factor = cfg.rotary_seq_len_interpolation_factor
            flags.append(f"--rotary-seq-len-interpolation-factor {integral(factor)}")
    return " ".join(flags).split()
