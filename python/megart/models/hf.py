"""Hugging Face GPT-2 interop: load a ``save_pretrained`` directory into any tensor-parallel
layout, and write one that ``GPT2LMHeadModel.from_pretrained`` loads.

GPT-2 stores its linear layers as Conv1D ([in, out], y = x W + b) and its fused attention
projection as [q | k | v] along the output; megart stores [out, in] and groups the fused
projection per head ([q_i, k_i, v_i] for head i), so that a tensor-parallel slice holds whole
heads. Everything else maps one to one.

Writing goes check_gpt2 -> gpt2_tensors -> write_gpt2, fed by the live model's gathers here
(GPT.save_hf_gpt2) or by a training checkpoint's files (megart.training.export_hf).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import megart.distributed as dist
from megart.errors import ConfigError
from megart.models.config import GPTConfig, architecture_flags, fit_vocab
from megart.tensor_parallel._group import group_rank, group_size


def _qkv_to_heads(w: torch.Tensor, heads: int) -> torch.Tensor:
    """[3h, ...] as [q | k | v] -> grouped per head."""
    return w.reshape(3, heads, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _qkv_from_heads(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _mapping(cfg: GPTConfig) -> list[tuple[str, str, str]]:
    """(megart name, GPT-2 name, conversion) for every parameter of a one-chunk GPT."""
    out = [
        ("chunk.wte.weight", "wte.weight", "vocab"),
        ("chunk.wpe.weight", "wpe.weight", ""),
        ("chunk.ln_f.weight", "ln_f.weight", "norm"),
        ("chunk.ln_f.bias", "ln_f.bias", ""),
    ]
    for i in range(cfg.num_layers):
        m, g = f"chunk.blocks.{i}.", f"h.{i}."
        out += [
            (m + "ln_1.weight", g + "ln_1.weight", "norm"),
            (m + "ln_1.bias", g + "ln_1.bias", ""),
            (m + "ln_2.weight", g + "ln_2.weight", "norm"),
            (m + "ln_2.bias", g + "ln_2.bias", ""),
            (m + "attn.qkv.weight", g + "attn.c_attn.weight", "conv1d,qkv"),
            (m + "attn.qkv.bias", g + "attn.c_attn.bias", "qkv"),
            (m + "attn.proj.weight", g + "attn.c_proj.weight", "conv1d"),
            (m + "attn.proj.bias", g + "attn.c_proj.bias", ""),
            (m + "mlp.fc.weight", g + "mlp.c_fc.weight", "conv1d"),
            (m + "mlp.fc.bias", g + "mlp.c_fc.bias", ""),
            (m + "mlp.proj.weight", g + "mlp.c_proj.weight", "conv1d"),
            (m + "mlp.proj.bias", g + "mlp.c_proj.bias", ""),
        ]
    return out


def _config_from_hf(hf: dict[str, Any]) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(
            f"GPT-2 activation {act!r} is not supported; megart's GPT uses GeLU "
            "with the tanh approximation (gelu_new)"
        )
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        seq_length=hf["n_positions"],
        hidden_size=hf["n_embd"],
        num_layers=hf["n_layer"],
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner"),  # None: 4 n_embd, as GPT-2
        layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
    )


def load_gpt2(
    cls: type, path: str, tp_group: dist.ProcessGroup | None, sequence_parallel: bool
) -> Any:
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json: is it a save_pretrained directory?")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root} has no .safetensors weights (only safetensors are read)")
    cfg = _config_from_hf(json.loads((root / "config.json").read_text()))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update({k.removeprefix("transformer."): v for k, v in load_file(str(f)).items()})
    model = cls(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)
    params = dict(model.named_parameters())
    t, r = group_size(tp_group), group_rank(tp_group)
    with torch.no_grad():
        for ours, theirs, conv in _mapping(cfg):
            w = tensors[theirs].float()
            if "conv1d" in conv:
                w = w.t()
            if "qkv" in conv:
                w = _qkv_to_heads(w, cfg.num_attention_heads)
            if conv == "vocab":
                w = fit_vocab(w, cfg.padded_vocab_size(t))
            p = params[ours]
            dim = getattr(p, "partition_dim", None)
            p.copy_(w if dim is None else w.chunk(t, dim)[r])
    return model


def _gather(p: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    dim = getattr(p, "partition_dim", None)
    t = group_size(tp_group)
    if dim is None or t == 1:
        return p.detach().clone()
    shard = p.detach().movedim(dim, 0).contiguous()
    out = torch.empty(t * shard.numel(), dtype=shard.dtype)
    dist.all_gather_into_tensor(out, shard.view(-1), group=tp_group)
    return out.view(t * shard.shape[0], *shard.shape[1:]).movedim(0, dim)


def check_gpt2(cfg: GPTConfig) -> None:
    """Refuses a model that a GPT-2 checkpoint cannot represent, naming each option: the
    megart train flag that gave it and the GPTConfig field."""
    flags = architecture_flags(cfg)
    unlike = [
        f"{flags[name]} ({name}={value!r}; GPT-2 has {gpt2!r})"
        for name, value, gpt2 in (
            ("normalization", cfg.normalization, "layernorm"),
            ("position_embedding", cfg.position_embedding, "learned"),
            ("activation", cfg.activation, "gelu"),
            ("bias", cfg.bias, True),
            ("untie_embeddings_and_output_weights", cfg.untie_embeddings_and_output_weights, False),
            # GPT-2 has one key/value head per query head.
            ("num_query_groups", cfg.query_groups, cfg.num_attention_heads),
        )
        if value != gpt2
    ]
    if unlike:
        raise ConfigError(
            "a GPT-2 checkpoint cannot represent " + ", ".join(unlike) + "; only models "
            "trained with GPT-2's own architecture can be written in its format"
        )


def gpt2_tensors(cfg: GPTConfig, full: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's tensors, by name, from ``full(name)``: the whole (not tensor-parallel) tensor of
    parameter ``name`` of a one-chunk GPT, vocabulary padding included. Called in
    ``_mapping`` order, which gathers across ranks rely on."""
    out = {}
    for ours, theirs, conv in _mapping(cfg):
        w = full(ours)
        if conv == "norm" and cfg.apply_layernorm_1p:
            w = w + 1  # GPT-2's LayerNorm holds the scale itself, not a zero-centred weight
        if conv == "vocab":
            w = w[: cfg.vocab_size]
        if "qkv" in conv:
            w = _qkv_from_heads(w, cfg.num_attention_heads)
        if "conv1d" in conv:
            w = w.t()
        out["transformer." + theirs] = w.contiguous()
    return out


def write_gpt2(cfg: GPTConfig, tensors: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Writes ``tensors`` (from gpt2_tensors) and GPT-2's config.json into directory ``path``."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_length,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        # None is GPT-2's 4 n_embd; anything else must be written, or the MLP loads misshapen.
        "n_inner": None if cfg.ffn_size == 4 * cfg.hidden_size else cfg.ffn_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layernorm_epsilon,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


def save_gpt2(model: Any, path: str) -> None:
    cfg: GPTConfig = model.cfg
    check_gpt2(cfg)
    tp_group = model.chunk.tp_group
    params = dict(model.named_parameters())
    # Every rank takes part in the gathers; tensor-parallel rank 0 writes.
    tensors = gpt2_tensors(cfg, lambda name: _gather(params[name], tp_group))
    if group_rank(tp_group) == 0:
        write_gpt2(cfg, tensors, path)
