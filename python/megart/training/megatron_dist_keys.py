"""The keys of Megatron-Core's sharded state dict (``GPTModel.sharded_state_dict()``, megatron-core
0.16.1) under which Megatron-LM's torch_dist store (megart.training.megatron_dist) holds a GPT's
tensors, and where in each key's global tensor one layer's (and one expert's) tensor lies.

TransformerBlock keys its layers in one of two ways. Homogeneous layers (every layer the same
spec: dense models, and MoE models with --moe-layer-freq 1) share one key per part, the
layer number the first dimension: ``decoder.layers.self_attention.linear_qkv.weight`` is
[num_layers, ...]. A mix of dense and MoE layers (--moe-layer-freq N > 1, or a 0/1 pattern,
even one of all 1s: Megatron-Core tells them by the flag, not the layers) keys each layer
apart, ``decoder.layers.N.<part>``, without that dimension (its non_homogeneous_layers). The
layer's norms are named as Transformer Engine's fused layers name them
(``self_attention.linear_qkv.layer_norm_weight``) whatever the layer spec, but under
multi-latent attention, whose local spec keeps every norm's own name
(``input_layernorm.weight``, ``self_attention.q_layernorm.weight``, ...), and its projections
(megart.training.megatron_mla.MLA_LINEARS) each have an ``_extra_state``.

An MoE layer's router is ``mlp.router.weight`` ([E, h] per layer). SequentialMLP keys its
experts by their global number (expert parallelism 1: the local number) as one more sharded
dimension after the layer's, under ``mlp.experts.experts.`` (its local_experts prefix
replaced): ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is [L, E, 2 f, h] under
SwiGLU (each expert's [gate; up]) with homogeneous layers, ``decoder.layers.N.mlp.experts
.experts.linear_fc1.weight`` [E, ...] per layer otherwise. Its ``_extra_state`` objects are
keyed by (layer, expert) offsets the same way. The shared experts (SharedExpertMLP) are keyed
as a dense MLP is, under ``mlp.shared_experts.``, their gate's ``mlp.shared_experts.gate_weight``
([1, h]) beside them.
"""

from __future__ import annotations

import itertools
import re

import torch

from megart.models.config import GPTConfig
from megart.models.megatron_names import NAMES, SHARED, megatron_layer_name
from megart.training.megatron_mla import mla_linears

LINEAR_LAYERS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
# The local spec's keys map (what TransformerLayer renames in its sharded state dict).
FUSED_LAYER_NORMS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
# SequentialMLP's module prefix of its experts, and the one of their sharded keys.
LOCAL_EXPERTS = "mlp.experts.local_experts."
SHARDED_EXPERTS = "mlp.experts.experts."
EXPERT_LINEAR_LAYERS = (SHARDED_EXPERTS + "linear_fc1", SHARDED_EXPERTS + "linear_fc2")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"decoder\.layers\.(.+)$")
_EXPERT = re.compile(re.escape(LOCAL_EXPERTS) + r"(\d+)\.(.+)$")
_MTP_EXPERTS = re.compile(
    r"(mtp\.layers\.\d+\.transformer_layer\.)" + re.escape(SHARDED_EXPERTS) + r"(.+)$"
)

# A multi-token prediction depth's layer, within the depth's names.
MTP_LAYER = ".transformer_layer."
# (index, count) of each sharded dimension before a tensor's own: its layer, its expert.
Leading = list[tuple[int, int]]


def per_layer_keys(cfg: GPTConfig) -> bool:
    """Whether Megatron-Core keys each layer of ``cfg`` apart (``decoder.layers.N.``): its
    TransformerBlock's non_homogeneous_layers, set by --moe-layer-freq as a pattern or N > 1."""
    freq = cfg.moe_layer_freq
    return isinstance(freq, (tuple, list)) or freq > 1


def to_fused_norm(part: str, cfg: GPTConfig) -> str:
    """A layer part's name as the local spec's sharded_state_dict_keys_map keys it: the
    layer's two norms under Transformer Engine's fused names, the attention's own norms
    (--qk-layernorm) under theirs; under multi-latent attention none is renamed (its spec has
    no map: megart.training.megatron_mla)."""
    if cfg.multi_latent_attention:
        return part
    for norm, fused in FUSED_LAYER_NORMS.items():
        if part.startswith(norm):
            return fused + part.removeprefix(norm)
    return part


def layer_key(layer: int, part: str, cfg: GPTConfig) -> tuple[str, Leading]:
    """The sharded key of Megatron-Core's ``decoder.layers.<layer>.<part>`` and the (index,
    count) of the sharded dimensions before the tensor's own: the layer (homogeneous layers),
    then the expert (an expert's tensor)."""
    part = to_fused_norm(part, cfg)
    leading: Leading = []
    if per_layer_keys(cfg):
        prefix = f"decoder.layers.{layer}."
    else:
        prefix = "decoder.layers."
        leading.append((layer, cfg.num_layers))
    expert = _EXPERT.match(part)
    if expert:
        leading.append((int(expert.group(1)), cfg.num_experts or 0))
        part = SHARDED_EXPERTS + expert.group(2)
    return prefix + part, leading


def sharded_keys(model: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Megatron-Core's whole state dict (``decoder.layers.N.`` names) under torch_dist's keys:
    each layer's (and expert's) tensor at its place in its key's global tensor."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    counts: dict[str, tuple[int, ...]] = {}
    for name, value in model.items():
        match = _LAYER.match(name)
        if match is None:
            key, leading = mtp_place(name, cfg)
            if not leading:
                out[key] = value
                continue
        else:
            key, leading = layer_key(int(match.group(1)), match.group(2), cfg)
        pieces.setdefault(key, {})[tuple(i for i, _ in leading)] = value
        counts[key] = tuple(n for _, n in leading)
    for key, held in pieces.items():
        places = list(itertools.product(*map(range, counts[key])))
        missing = [at for at in places if at not in held]
        if missing:
            raise ValueError(f"{key}: no tensor at {missing[0]} of {counts[key]}")
        first = held[places[0]]
        out[key] = torch.stack([held[at] for at in places]).view(*counts[key], *first.shape)
    return out


def layer_names(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch_dist's keys back to Megatron-Core's per-layer names (norms keep the fused
    names, which megart.models.megatron_names reads), either way of keying the layers."""
    out: dict[str, torch.Tensor] = {}
    for key, value in stored.items():
        apart, stacked = _LAYER.match(key), _STACKED.match(key)
        depth = _MTP_EXPERTS.match(key)
        if depth:  # a depth's experts, [E, ...]: Megatron-Core's names of each
            head, inner = depth.groups()
            for e, expert in enumerate(value.unbind(0)):
                out[f"{head}{LOCAL_EXPERTS}{e}.{inner}"] = expert
            continue
        if apart:
            layers, rest = [(int(apart.group(1)), value)], apart.group(2)
        elif stacked:
            layers, rest = list(enumerate(value.unbind(0))), stacked.group(1)
        else:
            out[key] = value
            continue
        for layer, tensor in layers:
            if not rest.startswith(SHARDED_EXPERTS):
                out[f"decoder.layers.{layer}.{rest}"] = tensor
                continue
            inner = rest.removeprefix(SHARDED_EXPERTS)
            for e, expert in enumerate(tensor.unbind(0)):
                out[f"decoder.layers.{layer}.{LOCAL_EXPERTS}{e}.{inner}"] = expert
    return out


def stored_place(name: str, cfg: GPTConfig) -> tuple[str, Leading, int | None]:
    """Where the one-chunk GPT's parameter ``name`` (megart's, without ``chunk.``) lies in the
    store: its key, the (index, count) of the key's sharded dimensions before the parameter's
    own (layer_key's; none for a tensor of no layer) and which half of the key's tensor it is
    (megart.models.megatron_names.megatron_layer_name: SwiGLU's gate and up are the halves of
    ``linear_fc1``; None for the whole tensor)."""
    if name in NAMES:
        return NAMES[name], [], None
    if name.startswith("mtp."):  # a depth's: keyed apart, no layer dimension
        head, sep, rest = name.partition(MTP_LAYER)
        if not sep:
            return name, [], None
        megatron, half = megatron_layer_name(rest, cfg)
        return (*mtp_place(head + sep + megatron, cfg), half)
    _, layer, rest = name.split(".", 2)
    megatron, half = megatron_layer_name(rest, cfg)
    key, leading = layer_key(int(layer), megatron, cfg)
    return key, leading, half


def mtp_place(name: str, cfg: GPTConfig) -> tuple[str, Leading]:
    """The sharded key of Megatron-Core's multi-token prediction parameter ``name``
    (``mtp.layers.K.``) and its leading (index, count): its own name, each depth keyed apart
    (no layer dimension), its layer's norms under the fused names a decoder layer's have
    (TransformerLayer's keys map); an MoE depth's experts under one key with the expert
    dimension first, as a decoder layer's keyed apart."""
    head, sep, part = name.partition(MTP_LAYER)
    if not sep:
        return name, []
    expert = _EXPERT.match(part)
    if expert:
        key = head + sep + SHARDED_EXPERTS + expert.group(2)
        return key, [(int(expert.group(1)), cfg.num_experts or 0)]
    return head + sep + to_fused_norm(part, cfg), []


def mtp_extra_state_keys(cfg: GPTConfig) -> list[str]:
    """The store's keys of the depths' ``_extra_state`` objects: each depth's eh_proj and its
    layer's linear layers (a layer numbered after the decoder's), no sharded dimension."""
    out = []
    for k in range(cfg.mtp_num_layers or 0):
        parts = [".eh_proj"] + [MTP_LAYER + p for p in _linear_parts(cfg.num_layers + k, cfg)]
        for part in parts:  # an expert's under the experts' key, numbered among them
            expert = _EXPERT.search(part)
            if expert:
                e, inner = expert.groups()
                part = f"{MTP_LAYER}{SHARDED_EXPERTS}{inner}"
                out.append(f"mtp.layers.{k}{part}._extra_state/shard_{e}_{cfg.num_experts}")
            else:
                out.append(f"mtp.layers.{k}{part}._extra_state/shard_0_1")
    return out


def _linear_parts(layer: int, cfg: GPTConfig) -> list[str]:
    """The linear layers (each with an ``_extra_state``) of layer ``layer``, in its order."""
    parts = [*(mla_linears(cfg) or LINEAR_LAYERS[:1]), LINEAR_LAYERS[1]]
    if cfg.is_moe_layer(layer):
        parts += [f"{LOCAL_EXPERTS}{e}.{fc}" for e in range(cfg.num_experts or 0)
                  for fc in ("linear_fc1", "linear_fc2")]  # fmt: skip
        if cfg.moe_shared_expert_intermediate_size is not None:  # SharedExpertMLP's, as a layer's
            parts += [SHARED + "linear_fc1", SHARED + "linear_fc2"]
    else:
        parts += LINEAR_LAYERS[2:]
    return parts


def extra_state_keys(layer: int, cfg: GPTConfig) -> list[str]:
    """The store's keys of layer ``layer``'s ``_extra_state`` objects (one per linear layer,
    one per expert's: the router has none), as Megatron-Core's unique_key names a
    ShardedObject's shard: ``key/shard_<offsets>_<shape>`` (no sharded dimension: ``0_1``)."""
    out = []
    for part in _linear_parts(layer, cfg):
        key, leading = layer_key(layer, f"{part}._extra_state", cfg)
        offsets = ".".join(str(i) for i, _ in leading) or "0"
        shape = ".".join(str(n) for _, n in leading) or "1"
        out.append(f"{key}/shard_{offsets}_{shape}")
    return out
