"""megart's GPT parameter names and Megatron-Core's GPTModel names, both ways.

The tensors are the same but for SwiGLU: megart keeps ``mlp.gate`` (silu applied) and
``mlp.fc`` apart, Megatron-Core one ``mlp.linear_fc1`` = [gate; up]. The fused q/k/v rows are
grouped per query group as [q of the group's heads, k, v] in both. A tied output layer reads
the word embedding in both (Megatron-Core's tied model has no ``output_layer.weight`` on a
single stage).

An MoE layer's (models.moe) router is ``mlp.router`` in both; its expert e's MLP is megart's
``mlp.experts.e`` and Megatron-Core's ``mlp.experts.local_experts.e`` (SequentialMLP's, the
local spec's without grouped GEMM), each named inside as a dense MLP is; so are its shared
experts, ``mlp.shared_experts`` in both (Megatron-Core's SharedExpertMLP), whose gate's weight
is megart's ``mlp.shared_expert_gate.weight`` and Megatron-Core's ``mlp.shared_experts.gate_weight``
(a parameter of SharedExpertMLP, not a module of its own).

Multi-token prediction's depths (models.mtp) have Megatron-Core's names in both,
``mtp.layers.K.{enorm,hnorm,eh_proj,final_layernorm}``, but for the depth's layer,
``mtp.layers.K.transformer_layer.`` followed by a decoder layer's names on each side.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from megart.models.config import GATED, GPTConfig

# megart name (after the chunk's prefix) -> Megatron-Core name; N is the layer number.
NAMES = {
    "wte.weight": "embedding.word_embeddings.weight",
    "wpe.weight": "embedding.position_embeddings.weight",
    "ln_f.weight": "decoder.final_layernorm.weight",
    "ln_f.bias": "decoder.final_layernorm.bias",
    "output_layer.weight": "output_layer.weight",
}
LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "attn.qkv": "self_attention.linear_qkv",
    "attn.proj": "self_attention.linear_proj",
    "attn.q_layernorm": "self_attention.q_layernorm",
    "attn.k_layernorm": "self_attention.k_layernorm",
    # Multi-latent attention's (models.mla; its proj is linear_proj as above).
    "attn.q_proj": "self_attention.linear_q_proj",
    "attn.q_down_proj": "self_attention.linear_q_down_proj",
    "attn.q_up_proj": "self_attention.linear_q_up_proj",
    "attn.kv_down_proj": "self_attention.linear_kv_down_proj",
    "attn.kv_up_proj": "self_attention.linear_kv_up_proj",
    "attn.kv_layernorm": "self_attention.kv_layernorm",
    "ln_2": "pre_mlp_layernorm",
    "mlp.fc": "mlp.linear_fc1",
    "mlp.proj": "mlp.linear_fc2",
}
FC1 = LAYER_NAMES["mlp.fc"]
# SwiGLU's linear_fc1 = [gate; up]: megart's layer parts of its halves, in that order.
FC1_HALVES = ("mlp.gate", "mlp.fc")
GATE, UP = 0, 1
_LAYER = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)$")
ROUTER = "mlp.router"
# A router's expert bias (--moe-router-enable-expert-bias), its name within a layer: Megatron-
# Core's TopKRouter keeps it as a persistent buffer, so it is in the model's state dict (fp32)
# but is no parameter (outside the optimizer and its gradient buffers; megart keeps it apart
# from its weights: models.moe_router.expert_bias_rows). Its key and the test for it are
# expert_bias_key and expert_bias_layer alone, so every reader and writer agrees on both.
EXPERT_BIAS = ROUTER + ".expert_bias"
_EXPERT_BIAS_KEY = re.compile(
    rf"(?:decoder\.layers\.(\d+)|mtp\.layers\.(\d+)\.transformer_layer)\.{re.escape(EXPERT_BIAS)}$"
)
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(.+)$")
_MEGATRON_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)$")
SHARED = "mlp.shared_experts."
# The shared experts' gate: megart's layer part and kind, Megatron-Core's name in the layer.
SHARED_GATE = ("mlp.shared_expert_gate.weight", SHARED + "gate_weight")
# --softmax-type learnable's sink logits (models.sinks): megart's layer part, Megatron-Core's name
# (a parameter of its DotProductAttention, the local spec's core attention).
SINK = ("attn.softmax_offset", "self_attention.core_attention.softmax_offset")
_SINK = re.compile(rf"blocks\.(\d+)\.{re.escape(SINK[0])}$")
_FC1_TENSOR = re.compile(r"\.linear_fc1\.(weight|bias)$")
# Transformer Engine's layer spec (Megatron's default on GPUs) fuses each norm into the linear
# layer after it: its parameters are the same norm's, under these names.
TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
    # Multi-latent attention's latent norms (--qk-layernorm), fused into its up-projections.
    "self_attention.linear_q_up_proj.layer_norm_": "self_attention.q_layernorm.",
    "self_attention.linear_kv_up_proj.layer_norm_": "self_attention.kv_layernorm.",
}


def megatron_part(part: str, cfg: GPTConfig) -> tuple[str, int | None]:
    """Megatron-Core's name of a megart layer's part ``part`` (``attn.qkv``, ``mlp.gate``, ...:
    the name between ``blocks.N.`` and ``.weight`` or ``.bias``) and which half of it the part
    is: GATE or UP (the first or second half of ``linear_fc1``) for SwiGLU's ``mlp.gate`` and
    ``mlp.fc``, None where the part is the whole tensor."""
    expert = _EXPERT.match(part)
    if expert:  # an expert's MLP: named inside as a dense one
        e, inner = expert.groups()
        megatron, half = megatron_part("mlp." + inner, cfg)
        return megatron.replace("mlp.", f"mlp.experts.local_experts.{e}.", 1), half
    if part.startswith(SHARED):  # the shared experts' MLP: likewise
        megatron, half = megatron_part("mlp." + part.removeprefix(SHARED), cfg)
        return megatron.replace("mlp.", SHARED, 1), half
    if part == ROUTER:
        return ROUTER, None
    if cfg.activation in GATED and part in FC1_HALVES:
        return FC1, FC1_HALVES.index(part)
    return LAYER_NAMES[part], None


def megatron_layer_name(rest: str, cfg: GPTConfig) -> tuple[str, int | None]:
    """Megatron-Core's name within a layer (after ``decoder.layers.N.``) of megart's ``rest``
    (after ``blocks.N.``: a part and ``.weight`` or ``.bias``), and which half of that tensor it
    is (megatron_part's)."""
    if rest in (SHARED_GATE[0], SINK[0]):  # a parameter of its module, not a layer's weight
        return dict((SHARED_GATE, SINK))[rest], None
    part, kind = rest.rsplit(".", 1)
    megatron, half = megatron_part(part, cfg)
    return f"{megatron}.{kind}", half


def expert_bias_key(layer: int, decoder_layers: int | None = None) -> str:
    """Megatron-Core's state dict key of layer ``layer``'s router's expert bias (the layer's
    number in the model, or in its chunk for a pipeline stage's state dict); with
    ``decoder_layers`` given, a layer numbered from there on is a multi-token prediction
    depth's (models.mtp: ``mtp.layers.K.transformer_layer.``)."""
    if decoder_layers is not None and layer >= decoder_layers:
        return f"mtp.layers.{layer - decoder_layers}.transformer_layer.{EXPERT_BIAS}"
    return f"decoder.layers.{layer}.{EXPERT_BIAS}"


def expert_bias_layer(name: str, decoder_layers: int = 0) -> int | None:
    """The layer number in Megatron-Core's state dict key ``name`` if it is a router's expert
    bias (expert_bias_key's; a depth K's numbered ``decoder_layers`` + K), else None: such an
    entry is a buffer, not a parameter."""
    match = _EXPERT_BIAS_KEY.match(name)
    if match is None:
        return None
    decoder, depth = match.groups()
    return int(decoder) if depth is None else decoder_layers + int(depth)


def is_fc1_halves(name: str, cfg: GPTConfig) -> bool:
    """Whether Megatron-Core's parameter ``name`` holds SwiGLU's [gate; up] (``linear_fc1``'s
    weight or bias; not Transformer Engine's norm fused into it)."""
    return cfg.activation in GATED and bool(_FC1_TENSOR.search(name))


def to_megatron(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Megatron-Core names for the whole model's ``state`` (megart's names, with or without
    the ``chunk.`` prefix of megart.models.GPT)."""
    state = {k.removeprefix("chunk."): v for k, v in state.items()}
    out = _mtp_names(state, cfg, to_megatron, "blocks.0.", "decoder.layers.0.")
    for name, value in state.items():
        if name in NAMES:
            out[NAMES[name]] = value
            continue
        sink = _SINK.match(name)
        if sink:
            out[f"decoder.layers.{sink.group(1)}.{SINK[1]}"] = value
        match = _LAYER.match(name)
        if not match:
            continue
        layer, part, kind = match.groups()
        megatron, half = megatron_layer_name(f"{part}.{kind}", cfg)
        if half == GATE:
            continue  # written with the up half, below
        if half == UP:
            value = torch.cat([state[f"blocks.{layer}.{h}.{kind}"] for h in _halves(part)])
        out[f"decoder.layers.{layer}.{megatron}"] = value
    return out


def from_megatron(state: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """megart's names (without a chunk prefix) for a Megatron-Core GPTModel's ``state``, of
    the local or Transformer Engine layer spec; ``_extra_state`` entries are dropped."""
    back = {v: k for k, v in NAMES.items()}
    layer_back = {v: k for k, v in LAYER_NAMES.items()}
    out = _mtp_names(state, cfg, from_megatron, "decoder.layers.0.", "blocks.0.")
    pattern = re.compile(r"decoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    for name, value in state.items():
        if name.endswith("_extra_state") or name.startswith("mtp."):
            continue
        for fused, norm in TE_NORMS.items():
            name = name.replace(fused, norm)
        if name in back:
            out[back[name]] = value
            continue
        for theirs, ours in (SHARED_GATE[::-1], SINK[::-1]):
            gate = re.fullmatch(rf"decoder\.layers\.(\d+)\.{re.escape(theirs)}", name)
            if gate:
                out[f"blocks.{gate.group(1)}.{ours}"] = value
                break
        if gate:
            continue
        match = pattern.match(name)
        ours = match and _megart_part(match.group(2), layer_back)
        if not ours:
            raise KeyError(f"{name}: not a Megatron-Core GPTModel parameter megart has")
        layer, _, kind = match.groups()
        if is_fc1_halves(name, cfg):
            for half, piece in zip(_halves(ours), value.chunk(2), strict=True):
                out[f"blocks.{layer}.{half}.{kind}"] = piece
        else:
            out[f"blocks.{layer}.{ours}.{kind}"] = value
    return out


def _megart_part(part: str, layer_back: dict[str, str]) -> str | None:
    """megart's layer part for Megatron-Core's ``part``, or None where megart has none."""
    expert = _MEGATRON_EXPERT.match(part)
    if expert:
        e, inner = expert.groups()
        dense = layer_back.get("mlp." + inner)
        return dense and dense.replace("mlp.", f"mlp.experts.{e}.", 1)
    if part.startswith(SHARED):
        dense = layer_back.get("mlp." + part.removeprefix(SHARED))
        return dense and dense.replace("mlp.", SHARED, 1)
    return ROUTER if part == ROUTER else layer_back.get(part)


def _halves(part: str) -> list[str]:
    """The gate and up parts of SwiGLU's fc1 whose megart up part is ``part`` (``mlp.fc`` or
    an expert's ``mlp.experts.e.fc``, the shared experts' ``mlp.shared_experts.fc``)."""
    owner = part.rsplit(".", 1)[0]
    return [f"{owner}.{h.rsplit('.', 1)[1]}" for h in FC1_HALVES]


_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.transformer_layer\.(.+)$")


def _mtp_names(
    state: dict[str, torch.Tensor],
    cfg: GPTConfig,
    convert: Callable[[dict[str, torch.Tensor], GPTConfig], dict[str, torch.Tensor]],
    ours: str,
    theirs: str,
) -> dict[str, torch.Tensor]:
    """The other side's names of ``state``'s multi-token prediction entries: a depth's own
    unchanged, its layer's converted (by ``convert``, to_megatron or from_megatron) as a layer
    0's (``ours``: this side's prefix of one, ``theirs`` the other side's)."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in state.items():
        if not name.startswith("mtp.") or name.endswith("_extra_state"):
            continue
        match = _MTP_LAYER.match(name)
        if match:
            layers.setdefault(match.group(1), {})[ours + match.group(2)] = value
        else:
            out[name] = value
    for k, layer in layers.items():
        for name, value in convert(layer, cfg).items():
            out[f"mtp.layers.{k}.transformer_layer." + name.removeprefix(theirs)] = value
    return out
