"""Offline conversion between megart checkpoints and Megatron-LM's legacy checkpoint
(``--ckpt-format torch``): the weights, under Megatron-Core's GPTModel names.

    megart convert-checkpoint --from megart --to megatron --load ckpt --save megatron-ckpt
    megart convert-checkpoint --from megatron --to megart --load megatron-ckpt --save ckpt

Megatron's file (``iter_NNNNNNN/mp_rank_00/model_optim_rng.pt``) holds ``args`` (an argparse
Namespace of its flags), ``checkpoint_version`` 3.0, ``iteration`` and ``model`` (the state
dict). Written: one tensor- and pipeline-parallel rank (Megatron reshards with its own
tools), the weights only (load it with --finetune, or --no-load-optim --no-load-rng). Read: a
checkpoint of one tensor- and pipeline-parallel rank, written as a megart release checkpoint
(weights only, --load under any megart layout reshards it, as after import-hf).
"""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.config import GPTConfig, fit_vocab
from megart.models.megatron_names import from_megatron, to_megatron
from megart.training.checkpoint import (
    FILE,
    TRACKER,
    iteration_dir,
    model_config,
    replace_text,
    required_latest_iteration,
    write_release,
)
from megart.training.shards import read_shards, whole_tensors

CHECKPOINT_VERSION = 3.0


def megatron_args(cfg: GPTConfig, iteration: int) -> argparse.Namespace:
    """The Megatron-LM flags (argparse names) that describe ``cfg`` on one rank."""
    return argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_size,
        num_attention_heads=cfg.num_attention_heads,
        group_query_attention=cfg.query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        kv_channels=cfg.head_dim,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.seq_length,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=cfg.padded_vocab_size(1),
        make_vocab_size_divisible_by=128,
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        norm_epsilon=cfg.layernorm_epsilon,
        position_embedding_type="rope"
        if cfg.position_embedding == "rotary"
        else "learned_absolute",
        rotary_base=int(cfg.rotary_base),
        rotary_interleaved=cfg.rotary_interleaved,
        swiglu=cfg.activation == "swiglu",
        add_bias_linear=cfg.bias,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        iteration=iteration,
        ckpt_format="torch",
    )


def megart_to_megatron(load_dir: str | os.PathLike, save_dir: str | os.PathLike) -> Path:
    """The latest checkpoint in megart's ``load_dir`` (any layout) as Megatron-LM's legacy
    checkpoint of one rank in ``save_dir``; returns its file."""
    iteration = required_latest_iteration(load_dir)
    shards = read_shards(iteration_dir(load_dir, iteration))
    cfg = model_config(shards[0, 0])
    whole = whole_tensors(shards, cfg)
    weights = to_megatron({k: v.clone() for k, v in whole.items()}, cfg)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in weights:  # the padding of one tensor-parallel rank, as Megatron's args say
            weights[name] = fit_vocab(weights[name], cfg.padded_vocab_size(1))
    state = {
        "args": megatron_args(cfg, iteration),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "model": weights,
    }
    out = iteration_dir(save_dir, iteration) / "mp_rank_00" / FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    replace_text(Path(save_dir) / TRACKER, f"{iteration}\n")
    return out


def read_megatron(load_dir: str | os.PathLike) -> tuple[GPTConfig, dict[str, Any], int]:
    """The model config, Megatron-Core state dict and iteration of the latest Megatron-LM
    legacy checkpoint in ``load_dir`` (one tensor- and pipeline-parallel rank)."""
    iteration = required_latest_iteration(load_dir, " (Megatron-LM's legacy format)")
    root = iteration_dir(load_dir, iteration)
    ranks = sorted(p.name for p in root.glob("mp_rank_*"))
    if ranks != ["mp_rank_00"]:
        raise ConfigError(
            f"{root} holds {', '.join(ranks) or 'no rank directories'}; megart converts a "
            "Megatron-LM checkpoint of one tensor- and pipeline-parallel rank (mp_rank_00): "
            "merge it with Megatron's checkpoint converter first"
        )
    path = root / "mp_rank_00" / FILE
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise ConfigError(f"{path} cannot be read as a Megatron-LM checkpoint ({e})") from e
    args = state.get("args")
    if args is None or "model" not in state:
        raise ConfigError(f"{path} is not a Megatron-LM legacy checkpoint (no args and model)")
    a = vars(args)
    cfg = GPTConfig(
        vocab_size=a.get("vocab_size") or a["padded_vocab_size"],
        seq_length=a["seq_length"],
        hidden_size=a["hidden_size"],
        num_layers=a["num_layers"],
        num_attention_heads=a["num_attention_heads"],
        ffn_hidden_size=a.get("ffn_hidden_size"),
        layernorm_epsilon=a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5)),
        normalization="rmsnorm" if a.get("normalization") == "RMSNorm" else "layernorm",
        position_embedding="rotary" if a.get("position_embedding_type") == "rope" else "learned",
        rotary_base=float(a.get("rotary_base", 10000)),
        rotary_interleaved=bool(a.get("rotary_interleaved", False)),
        activation="swiglu" if a.get("swiglu") else "gelu",
        bias=a.get("add_bias_linear", True),
        untie_embeddings_and_output_weights=a.get("untie_embeddings_and_output_weights", False),
        num_query_groups=a.get("num_query_groups") if a.get("group_query_attention") else None,
    )
    return cfg, state["model"], int(state.get("iteration", iteration))


def is_megatron(load_dir: str | os.PathLike) -> bool:
    """Whether the latest checkpoint in ``load_dir`` is Megatron-LM's legacy format (its file
    holds ``checkpoint_version``; megart's do not)."""
    from megart.training.checkpoint import latest_iteration

    iteration = latest_iteration(load_dir)
    path = None if iteration is None else iteration_dir(load_dir, iteration) / "mp_rank_00" / FILE
    if path is None or not path.exists():
        return False
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError):
        return False
    return isinstance(state, dict) and "checkpoint_version" in state


def megatron_to_megart(load_dir: str | os.PathLike, save_dir: str | os.PathLike) -> Path:
    """The latest Megatron-LM legacy checkpoint in ``load_dir`` as a megart release checkpoint
    (weights only; --load reshards it to any layout and starts at iteration 0)."""
    cfg, model, _ = read_megatron(load_dir)
    weights = from_megatron(model, cfg)
    return write_release(save_dir, cfg, weights, list(range(cfg.num_layers)))
