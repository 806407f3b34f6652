"""Megatron-LM's --use-checkpoint-args: the flags that define the model (and with
--use-mp-args-from-checkpoint-args the parallel layout) taken from the latest checkpoint in
--load (or the one of --ckpt-step), so that a resume or a fine-tuning run needs no model flags.

    megart train --load ckpt --use-checkpoint-args --train-iters 100 ...

It works on the flags the command line gave (argparse leaves an unset one out), before the
config is built, so the tokenizer's vocabulary and the layout checks see the checkpoint's values.
Each process reads the checkpoint's small records itself (memory-mapped; no process
group needed): megart's files (``model_config``, ``config``, ``tokenizer``; import-hf's release
checkpoints are such files), Megatron-LM's legacy files and torch_dist stores (their ``args``).

As Megatron-LM's load_args_from_checkpoint: the sizes (layers, hidden, MLP, heads, sequence
length, head size, position table, vocabulary) are taken only where the command line left them
unset, the architecture switches always ("forced", a contradicting command-line value is
overridden, and said so), the tokenizer (type and files) unless
--no-use-tokenizer-model-from-checkpoint-args. Where megart differs: see docs/training.md
(`--use-checkpoint-args`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megart.errors import ConfigError
from megart.models.config import GPTConfig
from megart.models.config_flags import megatron_position
from megart.models.stages import ends_of, uneven
from megart.models.window import as_flag_text
from megart.training import megatron_dist, tokenizer_record
from megart.training.checkpoint import model_config
from megart.training.checkpoint_dirs import NON_PERSISTENT_FLAGS, loads_pretrained, resume_dir
from megart.training.ckpt_files import (
    FILE,
    chosen_iteration,
    iteration_dir,
    rank_dir,
    saved_expert_parallel,
)
from megart.training.glu_flags import glu_args
from megart.training.megatron_args import config_from_args, integral, megatron_args
from megart.training.megatron_files import is_megatron_file, torch_load
from megart.training.megatron_mla import mla_flags_from
from megart.training.shards import layer_ids
from megart.training.yarn_flags import FIELDS as YARN_FLAGS
from megart.training.yarn_flags import yarn_train_flags

# TrainConfig fields set only where the command line left them unset (Megatron's force=False).
SIZES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length")
# The sliding window, set where the command line left it unset: Megatron-LM takes neither flag
# (megart's import-hf of a Mistral or windowed Qwen says to train with --use-checkpoint-args),
# and a fine-tuning run may change it, as it changes no weight's meaning.
WINDOW = ("window_size", "window_attn_skip_freq")
# Set whatever the command line gave (Megatron's force=True), megart's rope and norm extras too.
FORCED = (
    "num_query_groups",
    "group_query_attention",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "use_rope_scaling",
    "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor",
    *YARN_FLAGS,
    "disable_bias_linear",
    "add_qkv_bias",
    "swiglu",
    "squared_relu",
    "quick_geglu",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "untie_embeddings_and_output_weights",
    "apply_layernorm_1p",
    "qk_layernorm",
    "softmax_type",  # megart's extra: the sinks' weights mean nothing under another softmax
    "normalization",
    "layernorm_epsilon",
    "attention_dropout",
    "hidden_dropout",
)
# Mixture of experts, as Megatron-LM 0.16 takes them: the experts and their width always (a
# dense checkpoint's None too), the layers and the router's flags (forced) only from a
# checkpoint with experts, so that a dense one names no router setting. Its training flags
# (--moe-aux-loss-coeff, --moe-z-loss-coeff, --moe-router-load-balancing-type) stay the
# command line's, as in Megatron; megart takes --moe-router-dtype (which Megatron leaves to
# the command line) where the command line leaves it unset, as the window.
# --moe-shared-expert-gate, which Megatron does not force either, stays the command line's: a
# checkpoint of the other kind is refused by name (architecture_flags).
EXPERTS = ("num_experts", "moe_ffn_hidden_size")
ROUTER = (
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_topk_scaling_factor",
    "moe_shared_expert_intermediate_size",
)
TOKENIZER = tokenizer_record.FIELDS
INTERLEAVING = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
STAGES = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
MISSING = object()  # what a checkpoint does not record (None is a value: "unset")


def saved(
    load_dir: str | os.PathLike, step: int | None = None
) -> tuple[dict[str, Any], GPTConfig, bool, str]:
    """The checkpoint of iteration ``step`` (--ckpt-step; default the latest) in ``load_dir``
    as Megatron-LM's args (``vars``), its model, whether megart wrote it (its vocabulary is
    then the model's, a NullTokenizer's end-of-document id included) and a few words naming
    it."""
    otherwise = " (--use-checkpoint-args reads the model's flags from its latest checkpoint)"
    raw, where, root = checkpoint_records(load_dir, step, otherwise)
    if "args" in raw:  # Megatron-LM's file or store (megart's records beside them)
        return _from_args(vars(raw["args"]), raw.get("megart"), where)
    return _from_megart(root, raw) + (where,)


def checkpoint_records(
    load_dir: str | os.PathLike, step: int | None = None, otherwise: str = ""
) -> tuple[dict[str, Any], str, Path]:
    """The small records of the checkpoint of iteration ``step`` (default the latest) in
    ``load_dir``: a torch_dist store's common state, or its first ``mp_rank_*`` file (Megatron's
    legacy or megart's, memory-mapped); a few words naming it; its folder. ``otherwise`` ends
    the refusal when there is no checkpoint."""
    iteration = chosen_iteration(load_dir, step, "--ckpt-step", otherwise)
    root = iteration_dir(load_dir, iteration)
    if megatron_dist.is_dist_checkpoint(root):
        return megatron_dist.read_common(root), f"{root} (torch_dist)", root
    files = sorted(root.glob(f"mp_rank_*/{FILE}"))
    if not files:
        raise ConfigError(f"--load {load_dir}: {root} holds no mp_rank_*/{FILE}")
    raw = _read(files[0])
    return raw, f"{root} (torch)" if is_megatron_file(raw) else f"{root}", root


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = torch_load(path, mmap=True)  # only the small records are read from it
    except Exception as e:
        raise ConfigError(f"{path} cannot be read as a checkpoint file ({e})") from e
    if not isinstance(raw, dict) or not ("args" in raw or "config" in raw):
        raise ConfigError(f"{path} is neither megart's checkpoint file nor Megatron-LM's")
    return raw


def _from_args(a: dict[str, Any], extra: Any, where: str) -> tuple[Any, ...]:
    """Megatron's args; ``extra``: what megart keeps beside them in the files it writes."""
    a = dict(a)
    if isinstance(extra, dict) and extra.get("model_config") is not None:
        known = {f for f in GPTConfig.__dataclass_fields__}
        fields = {k: v for k, v in extra["model_config"].items() if k in known}
        return a, GPTConfig(**fields), True, where
    return a, config_from_args(a), False, where


def _from_megart(root: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], GPTConfig, bool]:
    """A megart file's records as Megatron's args: its model, its layout (the uneven stages from
    the layers of each pipeline rank's file) and its tokenizer."""
    cfg = model_config(raw)
    layout = raw["config"]
    tp, pp = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
    chunks = [layer_ids(raw, 0, pp, cfg)]
    for p in range(1, pp):  # a missing file is --load's to name
        path = root / rank_dir(0, p, pp, 0, saved_expert_parallel(raw)) / FILE
        chunks.append(layer_ids(_read(path), p, pp, cfg) if path.is_file() else chunks[0])
    first, last = ends_of([sum(map(len, c)) for c in chunks])
    per = layout.get("num_layers_per_virtual_pipeline_stage")
    # Interleaving by count (uneven stages take no per-stage count): the chunks of a rank.
    vpp = len(chunks[0]) if per is None and uneven(first, last) else 1
    a = vars(megatron_args(cfg, int(raw["iteration"]), tp, pp, vpp, first, last))
    a["num_layers_per_virtual_pipeline_stage"] = per
    a.update(hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout)
    a.update(raw.get("tokenizer") or {})
    return a, cfg, True


def flags_from(
    a: dict[str, Any],
    cfg: GPTConfig,
    megart_written: bool,
    given: dict[str, Any],
    mp: bool,
    tokenizer_model: bool,
) -> list[tuple[str, Any, bool]]:
    """(TrainConfig field, the checkpoint's value, forced) for each flag to take."""
    window_size, window_attn_skip_freq = as_flag_text(cfg.window_size, cfg.window_attn_skip_freq)
    values: dict[str, Any] = dict(
        window_size=window_size,
        window_attn_skip_freq=window_attn_skip_freq,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_size,
        num_attention_heads=cfg.num_attention_heads,
        seq_length=cfg.seq_length,
        num_query_groups=cfg.query_groups if cfg.query_groups != cfg.num_attention_heads else None,
        group_query_attention=cfg.query_groups != cfg.num_attention_heads,
        position_embedding_type=megatron_position(cfg),
        **yarn_train_flags(cfg),
        rotary_base=integral(cfg.rotary_base),
        rotary_percent=cfg.rotary_percent,
        rotary_interleaved=cfg.rotary_interleaved,
        use_rope_scaling=cfg.rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        rotary_seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
        disable_bias_linear=not cfg.bias,
        add_qkv_bias=cfg.add_qkv_bias,
        swiglu=cfg.activation == "swiglu",
        squared_relu=cfg.activation == "squared_relu",
        **glu_args(cfg),
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        apply_layernorm_1p=cfg.apply_layernorm_1p,
        qk_layernorm=cfg.qk_layernorm,
        softmax_type=cfg.softmax_type,
        normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=cfg.layernorm_epsilon,
        # Megatron-LM's args have them; megart's records too (import-hf's: 0).
        attention_dropout=a.get("attention_dropout", MISSING),
        hidden_dropout=a.get("hidden_dropout", MISSING),
    )
    out = [(f, values[f], False) for f in SIZES + WINDOW]
    out += [(f, values[f], True) for f in FORCED]
    out += moe_flags(cfg)
    out.append(("mtp_num_layers", cfg.mtp_num_layers, True))  # Megatron-LM forces it too
    out += mla_flags_from(cfg)
    # What depends on a size the command line gave is left to it: megart's position table is
    # --seq-length long, its head size --hidden-size / --num-attention-heads.
    if "seq_length" not in given:
        out.append(("max_position_embeddings", a.get("max_position_embeddings", MISSING), False))
    if not {"hidden_size", "num_attention_heads"} & set(given):
        out.append(("kv_channels", a.get("kv_channels", MISSING), False))
    recorded = tokenizer_record.record(a) if tokenizer_model else None
    if recorded:
        out += [(f, recorded[f], True) for f in TOKENIZER if f in recorded]
    vocab = cfg.vocab_size
    if megart_written and (recorded or {}).get("tokenizer_type") == "NullTokenizer":
        vocab -= 1  # the flag's: NullTokenizer adds its end-of-document id to it
    if not recorded or recorded["tokenizer_type"] == "NullTokenizer":
        out.append(("vocab_size", vocab, False))  # else the tokenizer's vocabulary decides
    if mp:
        out += [
            ("tensor_model_parallel_size", a.get("tensor_model_parallel_size") or 1, True),
            ("pipeline_model_parallel_size", a.get("pipeline_model_parallel_size") or 1, True),
        ]
        if not set(INTERLEAVING) & set(given):
            per, count = (a.get(f) for f in INTERLEAVING)
            if per is not None:
                out.append((INTERLEAVING[0], per, False))
            elif (count or 1) > 1:
                out.append((INTERLEAVING[1], count, False))
        if not set(STAGES) & set(given):
            out += [(f, a.get(f, MISSING), False) for f in STAGES]
    return out


def moe_flags(cfg: GPTConfig) -> list[tuple[str, Any, bool]]:
    """flags_from's mixture-of-experts part (see EXPERTS and ROUTER)."""
    if cfg.num_experts is None:
        return [(f, None, True) for f in EXPERTS]
    freq = cfg.moe_layer_freq  # TrainConfig's is the flag's text
    values = {
        "num_experts": cfg.num_experts,
        "moe_ffn_hidden_size": cfg.moe_ffn_hidden_size,  # None: --ffn-hidden-size's
        "moe_layer_freq": str(list(freq) if isinstance(freq, tuple) else freq),
        "moe_router_topk": cfg.moe_router_topk,
        "moe_router_pre_softmax": cfg.moe_router_pre_softmax,
        "moe_router_score_function": cfg.moe_router_score_function,
        "moe_router_topk_scaling_factor": cfg.moe_router_topk_scaling_factor,
        "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
    }
    out = [(f, values[f], True) for f in EXPERTS + ROUTER]
    return out + [("moe_router_dtype", cfg.moe_router_dtype, False)]


def apply(
    given: dict[str, Any],
    mp: bool = False,
    tokenizer_model: bool = True,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``given`` (TrainConfig fields the command line set; store_true switches always there)
    with the checkpoint's flags in --load (``given["load"]``) taken as Megatron-LM's
    --use-checkpoint-args takes them; ``mp``: --use-mp-args-from-checkpoint-args,
    ``tokenizer_model``: not --no-use-tokenizer-model-from-checkpoint-args. Each value set is
    said on rank 0 (``say``, default print)."""
    load = given.get("load")
    if loads_pretrained(load, given.get("pretrained_checkpoint")):
        # What this run will load (Megatron reads both, --load's winning).
        load = given["pretrained_checkpoint"]
    elif load:  # the checkpoint --load resumes: a newer non-persistent one, as Megatron's
        load = resume_dir(SimpleNamespace(**{**NON_PERSISTENT_FLAGS, **given}))
    if not load:
        raise ConfigError(
            "--use-checkpoint-args takes the model's flags from the checkpoint in --load: give "
            "--load DIR (Megatron-LM goes on with the command line's flags; megart refuses "
            "rather than train another model than asked)"
        )
    if say is None:
        say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda line: None)
    a, cfg, megart_written, where = saved(load, given.get("ckpt_step"))
    out = dict(given)
    say(f"--use-checkpoint-args: the model's flags from {where}")
    for field, value, forced in flags_from(a, cfg, megart_written, given, mp, tokenizer_model):
        # A switch (store_true) is in ``given`` always: given only where it is on.
        explicit = field in given and given[field] is not False
        if value is MISSING or (value is None and not explicit) or (explicit and not forced):
            continue
        note = ""
        if explicit and given[field] != value:
            flag = "--" + field.replace("_", "-")
            was = flag if given[field] is True else f"{flag} {given[field]}"
            note = f" (overriding the command line's {was})"
        out[field] = value
        say(f"Setting {field} to {value} from checkpoint{note}")
    return out
