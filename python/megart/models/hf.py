"""Hugging Face interop: load a ``save_pretrained`` directory of a GPT-2, a Llama, a Mistral, a
Qwen2, a Qwen3, a Nemotron, a Mixtral, a Qwen3-MoE, a Qwen2-MoE or a DeepSeek-V3 into any
tensor-parallel layout, and write one that transformers' ``from_pretrained`` loads.

Each format is a module (megart.models.hf_gpt2, hf_llama, hf_mistral, hf_qwen2, hf_qwen3,
hf_nemotron, hf_mixtral, hf_qwen3_moe, hf_qwen2_moe, hf_deepseek_v3) that maps names and
layouts between its whole tensors and the whole tensors of megart's one-chunk GPT. What is
common lives here: reading and writing the files, cutting each whole tensor into this rank's
tensor-parallel slice, gathering the slices back, and choosing the format (by config.json's
model_type when reading; by the model's architecture when writing).

Writing goes check -> hf_tensors -> megart.models.hf_files.write_hf, fed one tensor at a time
by the live model's gathers here (GPT.save_hf) or by a training checkpoint's files
(megart.training.export_hf).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import megart.distributed as dist
from megart.errors import ConfigError
from megart.models import (
    hf_deepseek_v3,
    hf_gpt2,
    hf_llama,
    hf_mistral,
    hf_mixtral,
    hf_nemotron,
    hf_qwen2,
    hf_qwen2_moe,
    hf_qwen3,
    hf_qwen3_moe,
)
from megart.models.config import GPTConfig
from megart.models.hf_files import DEFAULT_SHARD, check_dtype, parse_size, write_hf
from megart.models.mtp_checks import refuse_mtp
from megart.models.sink_checks import refuse_sinks
from megart.models.vocab import fit_vocab
from megart.tensor_parallel._group import group_rank, group_size

# A Llama-style model without a window is written as a Llama, one with a window as a Mistral,
# one with query/key norms as a Qwen3, one with biases on q/k/v alone as a Qwen2; squared ReLU
# with zero-centred LayerNorm as a Nemotron; one with experts in every layer as a Mixtral, one
# with experts and query/key norms as a Qwen3-MoE, one with experts and gated shared experts as
# a Qwen2-MoE (the others refuse experts, or shared experts): each check() takes only its own,
# so at most one format takes a model. A model with multi-latent attention is written as a
# DeepSeek-V3 only (the others' checks do not look at the attention's kind).
WRITERS = (hf_gpt2, hf_llama, hf_mistral, hf_qwen2, hf_qwen3, hf_nemotron, hf_mixtral,
           hf_qwen3_moe, hf_qwen2_moe)  # fmt: skip
# By config.json's model_type.
FORMATS = {m.MODEL_TYPE: m for m in (*WRITERS, hf_deepseek_v3)}
# Formats megart knows and cannot represent, by model_type: why.
UNREPRESENTABLE: dict[str, str] = {
    "deepseek_v2": "its multi-latent attention trains in megart (--multi-latent-attention), "
    "and DeepSeek-V3's Hugging Face layout is read, but DeepSeek-V2's (softmax routing, "
    "its own group-limited routing and rope layout) is not"
}
# Parameters whose rows are the (padded) vocabulary.
VOCAB_ROWS = ("chunk.wte.weight", "chunk.output_layer.weight")


def read_format(path: str | Path, expect: str | None = None) -> tuple[ModuleType, GPTConfig]:
    """The format module and the GPTConfig of the directory ``path``; ``expect`` (a
    model_type) refuses other formats."""
    return read_format_noted(path, expect)[:2]


def read_format_noted(
    path: str | Path, expect: str | None = None
) -> tuple[ModuleType, GPTConfig, str | None]:
    """read_format, with the note to give once where the files hold less than config.json
    says (a format's ``fit_files``: DeepSeek-V3's multi-token prediction layers), else None."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json: is it a save_pretrained directory?")
    hf = json.loads((root / "config.json").read_text())
    kind = hf.get("model_type")
    if kind in UNREPRESENTABLE:
        raise ConfigError(
            f"{root} holds a {kind}, which megart cannot read: {UNREPRESENTABLE[kind]}"
        )
    if kind not in FORMATS or expect not in (None, kind):
        known = [expect] if expect else list(FORMATS)
        raise ConfigError(
            f"{root} holds a model of type {kind!r}; megart reads {', '.join(known)} "
            "checkpoints (config.json's model_type)"
        )
    fmt = FORMATS[kind]
    cfg, note = fmt.config_from_hf(hf), None
    if hasattr(fmt, "fit_files"):
        cfg, note = fmt.fit_files(cfg, stored_names(root))
    return fmt, cfg, note


def stored_names(root: Path) -> set[str]:
    """The tensor names in the directory's safetensors files (their headers only)."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return set()
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as opened:
            names.update(opened.keys())
    return names


def format_name(path: str | Path) -> str:
    """The name of the format ("GPT-2" or "Llama") of the directory ``path``."""
    return read_format(path)[0].NAME


def lazy_tensors(path: str | Path, fmt: ModuleType) -> Callable[[str], torch.Tensor]:
    """``take(name)``: the tensor of that name (without the format's FILE_PREFIX) in the
    directory ``path``'s safetensors files, in float32, read from the file when asked for
    (the files are memory-mapped, never read whole)."""
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root} has no .safetensors weights (only safetensors are read)")
    opened = [safe_open(str(f), framework="pt") for f in files]
    where = {k.removeprefix(fmt.FILE_PREFIX): (f, k) for f in opened for k in f.keys()}

    def take(name: str) -> torch.Tensor:
        if name not in where:
            raise ConfigError(f"{root}: no file holds {name}; the {fmt.NAME} is incomplete")
        handle, key = where[name]
        return handle.get_tensor(key).float()

    return take


def load_hf(
    cls: type,
    path: str,
    tp_group: dist.ProcessGroup | None,
    sequence_parallel: bool,
    expect: str | None = None,
) -> Any:
    """A ``cls`` (megart's GPT) holding this rank's slice of the model in ``path``. The files
    are opened lazily and each tensor converted and copied into its parameter in turn, so the
    load holds the model and one tensor, not copies of the whole."""
    fmt, cfg, note = read_format_noted(path, expect)
    if note:
        warnings.warn(note, stacklevel=3)
    take = lazy_tensors(path, fmt)
    model = cls(cfg, tp_group=tp_group, sequence_parallel=sequence_parallel)
    params = dict(model.named_parameters())
    # Buffers a format carries (DeepSeek-V3's expert biases), whole on every rank.
    buffers = {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}
    t, r = group_size(tp_group), group_rank(tp_group)
    with torch.no_grad():
        for name, w in fmt.to_megart(cfg, take):
            if name in VOCAB_ROWS:
                w = fit_vocab(w, cfg.padded_vocab_size(t))
            if name in buffers:
                buffers.pop(name).copy_(w)
                continue
            p = params.pop(name)
            dim = getattr(p, "partition_dim", None)
            p.copy_(w if dim is None else w.chunk(t, dim)[r])
    assert not params and not buffers, f"no conversion for {sorted(params) + sorted(buffers)}"
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


def writer(cfg: GPTConfig, expect: str | None = None) -> ModuleType:
    """The format that ``cfg``'s model is written in: GPT-2's for GPT-2's architecture,
    Llama's for RMSNorm, rotary positions and SwiGLU (Mistral's with a window in every layer,
    Qwen3's with query/key norms, Qwen2's with biases on q/k/v alone); ``expect`` (a
    model_type) insists on one. A model no format can represent is refused with what each
    format lacks."""
    if not cfg.multi_latent_attention:  # DeepSeek-V3's files hold the depths
        refuse_mtp(cfg.mtp_num_layers, "Hugging Face's formats but DeepSeek-V3's")
    refuse_sinks(cfg.softmax_type, "Hugging Face's formats")
    refusals = []
    for fmt in (hf_deepseek_v3,) if cfg.multi_latent_attention else WRITERS:
        if expect not in (None, fmt.MODEL_TYPE):
            continue
        try:
            fmt.check(cfg)
            return fmt
        except ConfigError as e:
            refusals.append(str(e))
    raise ConfigError("; and ".join(refusals))


def save_hf(
    model: Any,
    path: str,
    expect: str | None = None,
    dtype: str = "float32",
    max_shard_size: str = DEFAULT_SHARD,
) -> None:
    """Writes ``model`` (megart's GPT, this rank's slice) as a Hugging Face directory; see
    megart.models.hf_files.write_hf for ``dtype`` and ``max_shard_size``."""
    cfg: GPTConfig = model.cfg
    # Checked before the gathers, on every rank: none may stop while the others wait.
    check_dtype(dtype)
    limit = parse_size(max_shard_size)
    fmt = writer(cfg, expect)
    tp_group = model.chunk.tp_group
    # The expert biases (buffers) are whole on every rank: _gather copies them.
    params = dict(model.named_parameters()) | dict(model.named_buffers())

    def full(name: str) -> torch.Tensor:
        return _gather(params[name], tp_group)

    # Every rank takes part in the gathers; tensor-parallel rank 0 writes.
    tensors = fmt.hf_tensors(cfg, full)
    if group_rank(tp_group) == 0:
        write_hf(Path(path), fmt.hf_config(cfg), tensors, dtype, limit)
    else:
        for _ in tensors:  # the other ranks' part of each gather
            pass
