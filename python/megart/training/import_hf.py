"""A Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3, Nemotron, Mixtral, Qwen3-MoE, Qwen2-MoE or
DeepSeek-V3 directory as a megart checkpoint, to fine-tune under any layout (experts at
tensor-parallel size 2 or more need --sequence-parallel in megart train).

    import_checkpoint("gpt2-dir", "ckpt")  # megart import-hf --input gpt2-dir --save ckpt
    # then: megart train --load ckpt --vocab-size 50257 --num-layers 12 ... (any tp x pp),
    # the model's flags as train_flags gives them (import-hf prints them)

The checkpoint is what Megatron calls a release checkpoint: the weights alone, marked
``release``, in one rank's file or, with ``tp``/``pp``, in the files of that tensor- and
pipeline-parallel layout (as Megatron's converter writes a target layout: each file is written
without the whole model in memory, and a run of that layout reads only its own). ``--load`` of
it loads the weights only and starts at iteration 0 (as ``--finetune``), resharded to the
run's layout like any checkpoint of another layout (megart.training.reshard).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models import GPTConfig, chunk_layers
from megart.models.config import MEGATRON_NORMS
from megart.models.config_flags import megatron_position
from megart.models.hf import VOCAB_ROWS, lazy_tensors, read_format_noted
from megart.models.mla_checks import mla_flags
from megart.models.vocab import fit_vocab
from megart.models.yarn import yarn_flags
from megart.training.checkpoint_save import write_release_ranks
from megart.training.megatron_args import integral
from megart.training.shards import partition_dims, split_shard, whole_name
from megart.training.tokenizer_record import record

# What --apply-layernorm-1p centres: every norm's weight, --qk-layernorm's (a Qwen3's) too.
NORM_WEIGHTS = (
    "ln_1.weight",
    "ln_2.weight",
    "ln_f.weight",
    "q_layernorm.weight",
    "k_layernorm.weight",
    "kv_layernorm.weight",  # multi-latent attention's (q_layernorm's is above)
    "enorm.weight",  # multi-token prediction's (its final_layernorm's is below)
    "hnorm.weight",
    "final_layernorm.weight",
)


def import_checkpoint(
    input_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    seq_length: int | None = None,
    apply_layernorm_1p: bool = False,
    tp: int = 1,
    pp: int = 1,
) -> list[Path]:
    """Writes the GPT-2 or Llama in ``input_dir`` (transformers' save_pretrained files) as a
    release checkpoint in ``save_dir``, of ``tp`` x ``pp`` rank files; returns them.
    ``seq_length`` is the length to train with: a GPT-2 keeps that many of its learned
    positions (default all, n_positions); a Llama's rotary positions have no table, so any
    length is the same weights (default its max_position_embeddings). ``apply_layernorm_1p``
    writes a model for ``megart train --apply-layernorm-1p``: the same network, its norm
    weights stored zero-centred (the file's minus 1).

    The files are converted one pipeline stage at a time, each tensor read from the
    memory-mapped input when its stage is written: the import holds one stage's weights (all
    its tensor-parallel slices), never the whole model."""
    return _imported(input_dir, save_dir, seq_length, apply_layernorm_1p, tp, pp)[0]


def import_for_training(
    input_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    seq_length: int | None = None,
    apply_layernorm_1p: bool = False,
    tp: int = 1,
    pp: int = 1,
) -> str:
    """import_checkpoint, then what import-hf prints: the release checkpoint written and the
    megart train flags that load it (--use-checkpoint-args, or the model's flags spelled out)."""
    files, cfg, note = _imported(input_dir, save_dir, seq_length, apply_layernorm_1p, tp, pp)
    flags = shlex.join(train_flags(cfg))  # a list of --window-attn-skip-freq quoted
    what = f"{files[0]}" if len(files) == 1 else f"{files[0].parents[1]}: {len(files)} rank files"
    layout = "" if len(files) == 1 else f" (saved for tp {tp} x pp {pp}; any layout loads it)"
    said = (
        f"{what}: release checkpoint{layout}; train with --load {save_dir} "
        f"--use-checkpoint-args, or with --load {save_dir} {flags}"
    )
    return said if note is None else f"megart: {note}\n{said}"


def _imported(
    input_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    seq_length: int | None,
    apply_layernorm_1p: bool,
    tp: int,
    pp: int,
) -> tuple[list[Path], GPTConfig, str | None]:
    """(the release files written, the model's GPTConfig as recorded in them, the note on
    what config.json says the files do not hold, if any: read_format_noted's)."""
    fmt, cfg, note = read_format_noted(input_dir)
    take = lazy_tensors(input_dir, fmt)
    if apply_layernorm_1p:
        # A checkpoint records its model's flags and train --load refuses another model's, so
        # the choice is made here, once, for the stored weights.
        cfg = dataclasses.replace(cfg, apply_layernorm_1p=True)
    learned = cfg.position_embedding == "learned"
    if seq_length is not None and seq_length != cfg.seq_length:
        if seq_length < 1 or (learned and seq_length > cfg.seq_length):
            what = f"{cfg.seq_length} learned positions" if learned else "rotary positions"
            limit = f"1 to {cfg.seq_length}" if learned else "a positive length"
            raise ConfigError(f"--seq-length {seq_length}: {input_dir} has {what}; give {limit}")
        cfg = dataclasses.replace(cfg, seq_length=seq_length)
    for flag, size in (("tensor", tp), ("pipeline", pp)):
        if size < 1:
            raise ConfigError(f"--target-{flag}-parallel-size {size}: give 1 or more")
    cfg.check_layout(tp=tp, pp=pp)

    def stored(name: str, whole: torch.Tensor) -> torch.Tensor:
        """The HF file's whole tensor as the checkpoint holds it."""
        if name in VOCAB_ROWS:
            whole = fit_vocab(whole, cfg.padded_vocab_size(tp))
        if apply_layernorm_1p and name.endswith(NORM_WEIGHTS):
            whole = whole - 1
        if name == "chunk.wpe.weight":
            # Position p's embedding does not depend on how many follow it: the first rows
            # are the model for shorter sequences.
            whole = whole[: cfg.seq_length]
        return whole

    def stages() -> Iterator[tuple[tuple[int, int], dict[str, torch.Tensor], list[int]]]:
        for p in range(pp):
            (layers,) = chunk_layers(cfg.num_layers, p, pp)
            dims = partition_dims(cfg, tuple(layers), p == 0, p == pp - 1)
            key_of = {whole_name(key, layers): key for key in dims}
            ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
            for name, whole in fmt.to_megart(cfg, take, wanted=key_of):
                whole = stored(name, whole)
                for t in range(tp):
                    # A copy of the slice, so the file holds only this rank's part.
                    ranks[t][key_of[name]] = split_shard(whole, dims[key_of[name]], tp, t).clone()
            missing = set(dims) - set(ranks[0])
            assert not missing, f"no conversion for {sorted(missing)}"  # every format maps all
            for t in range(tp):
                yield (t, p), ranks[t], list(layers)

    files = write_release_ranks(
        save_dir, cfg, tp, pp, stages(), _tokenizer(input_dir), _expert_bias(cfg, fmt, take)
    )
    return files, cfg, note


def _expert_bias(cfg: GPTConfig, fmt: Any, take: Any) -> torch.Tensor | None:
    """Every layer's expert bias, [layers, E] (zero rows for dense layers; the multi-token
    prediction depths' layers after the decoder's), from a format that carries them as
    ``chunk.blocks.i.mlp.router.expert_bias`` and ``chunk.mtp.layers.k.transformer_layer.mlp.
    router.expert_bias`` (DeepSeek-V3's e_score_correction_bias): what the checkpoint records
    beside the weights (models.moe_router.expert_bias_rows)."""
    if not cfg.moe_router_enable_expert_bias:
        return None
    assert cfg.num_experts is not None
    depths = cfg.mtp_num_layers or 0
    names = {f"chunk.blocks.{i}.mlp.router.expert_bias": i for i in range(cfg.num_layers)}
    names |= {
        f"chunk.mtp.layers.{k}.transformer_layer.mlp.router.expert_bias": cfg.num_layers + k
        for k in range(depths)
    }
    rows = torch.zeros(cfg.num_layers + depths, cfg.num_experts)
    for name, bias in fmt.to_megart(cfg, take, wanted=names):
        rows[names[name]] = bias
    return rows


def _tokenizer(input_dir: str | os.PathLike) -> dict[str, str] | None:
    """The directory's own tokenizer, where save_pretrained wrote one beside the weights, as
    the checkpoint records it (then export-hf saves it back without being told)."""
    root = Path(input_dir)
    if not any((root / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return record({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(root)})


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
        f"--position-embedding-type {megatron_position(cfg)}",
    ]
    if cfg.multi_latent_attention:
        flags.append(mla_flags(cfg))
    if cfg.mtp_num_layers:  # DeepSeek-V3's depths (the loss's factor is the run's choice)
        flags.append(f"--mtp-num-layers {cfg.mtp_num_layers}")
    switches = {
        "--apply-layernorm-1p": cfg.apply_layernorm_1p,
        "--qk-layernorm": cfg.qk_layernorm,
        "--swiglu": cfg.activation == "swiglu",
        "--squared-relu": cfg.activation == "squared_relu",
        "--disable-bias-linear": not cfg.bias,
        "--add-qkv-bias": cfg.add_qkv_bias,
        "--untie-embeddings-and-output-weights": cfg.untie_embeddings_and_output_weights,
    }
    flags += [flag for flag, on in switches.items() if on]
    if cfg.query_groups != cfg.num_attention_heads:
        flags.append(f"--group-query-attention --num-query-groups {cfg.query_groups}")
    if cfg.kv_channels is not None:  # heads of another width than h / heads (Qwen3's)
        flags.append(f"--kv-channels {cfg.head_dim}")
    if cfg.position_embedding == "rotary":
        flags.append(f"--rotary-base {integral(cfg.rotary_base)}")
        if cfg.rotary_percent != 1:  # part of each head turning (Nemotron's half)
            flags.append(f"--rotary-percent {cfg.rotary_percent!r}")
        if cfg.rotary_interleaved:
            flags.append("--rotary-interleaved")
        if cfg.rope_scaling:
            flags.append(f"--use-rope-scaling --rope-scaling-factor {cfg.rope_scaling_factor!r}")
        if cfg.rotary_seq_len_interpolation_factor is not None:
            factor = cfg.rotary_seq_len_interpolation_factor
            flags.append(f"--rotary-seq-len-interpolation-factor {integral(factor)}")
        if cfg.rope_type == "yarn":
            flags.append(yarn_flags(cfg))
    if any(cfg.layer_window(i) is not None for i in range(cfg.num_layers)):
        assert cfg.window_size is not None
        flags.append(f"--window-size {cfg.window_size[0]},{cfg.window_size[1]}")
        skip = cfg.window_attn_skip_freq
        if isinstance(skip, tuple):  # Megatron's list form, without spaces: one argument
            flags.append("--window-attn-skip-freq [" + ",".join(map(str, skip)) + "]")
        elif skip is not None:
            flags.append(f"--window-attn-skip-freq {skip}")
    return " ".join(flags + moe_flags(cfg)).split()


def moe_flags(cfg: GPTConfig) -> list[str]:
    """--num-experts and the --moe- flags that shape the network, where not Megatron's default
    (none without experts). The auxiliary losses (--moe-aux-loss-coeff, --moe-z-loss-coeff,
    --moe-router-load-balancing-type) and --moe-router-dtype are how a run trains, as --bf16
    is, and are left to it: a Mixtral's, Qwen3-MoE's or Qwen2-MoE's router_aux_loss_coef in
    particular weighs another loss (transformers' pools every layer's routing into one
    statistic and counts each of the k choices, about k / layers times Megatron's sum of
    per-layer losses), applied only with output_router_logits, which their released configs
    leave off."""
    if cfg.num_experts is None:
        return []
    flags = [f"--num-experts {cfg.num_experts}"]
    if cfg.moe_ffn_hidden_size is not None:  # experts of another width than --ffn-hidden-size
        flags.append(f"--moe-ffn-hidden-size {cfg.moe_ffn_hidden_size}")
    freq = cfg.moe_layer_freq
    if isinstance(freq, tuple):  # one argument, as --window-attn-skip-freq's list
        flags.append("--moe-layer-freq [" + ",".join(map(str, freq)) + "]")
    elif freq != 1:
        flags.append(f"--moe-layer-freq {freq}")
    if cfg.moe_router_topk != 2:
        flags.append(f"--moe-router-topk {cfg.moe_router_topk}")
    if cfg.moe_router_pre_softmax:
        flags.append("--moe-router-pre-softmax")
    if cfg.moe_router_score_function != "softmax":
        flags.append(f"--moe-router-score-function {cfg.moe_router_score_function}")
    if cfg.moe_router_topk_scaling_factor is not None:
        flags.append(f"--moe-router-topk-scaling-factor {cfg.moe_router_topk_scaling_factor!r}")
    if cfg.moe_shared_expert_intermediate_size is not None:
        flags.append(
            f"--moe-shared-expert-intermediate-size {cfg.moe_shared_expert_intermediate_size}"
        )
    if cfg.moe_shared_expert_gate:
        flags.append("--moe-shared-expert-gate")
    if cfg.moe_router_enable_expert_bias:
        flags.append("--moe-router-enable-expert-bias")
    if cfg.moe_router_num_groups is not None:
        flags.append(f"--moe-router-num-groups {cfg.moe_router_num_groups}")
        flags.append(f"--moe-router-group-topk {cfg.moe_router_group_topk}")
    return flags
