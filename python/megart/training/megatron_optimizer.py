"""The optimizer state of Megatron-LM's legacy checkpoint, both ways: megart's Adam state dict
as Megatron-LM's non-distributed optimizer holds it for the same model, and back.

Megatron-Core (megatron/core/optimizer/__init__.py, ``_get_param_groups``) puts a model's
parameters into param groups keyed by their overrides, sorted with the plain group first: with
its default config two groups, weight decay on every parameter but biases and 1-d ones (the
plain group: ``wd_mult`` 1) and none on those (``wd_mult`` 0); with --decoupled-lr a third
between them, the word embedding and the output layer (decayed, their own ``max_lr`` and
``min_lr``, ``default_config`` False; the file's args say whether it is there). Each group
lists its parameters in the order of GPTModel's ``named_parameters()``, model chunk after
model chunk, and carries Megatron's keys besides torch's (``wd_mult``, ``lr_mult``,
``is_expert_parallel``, ``is_decoupled_lr``, ``default_config``, ``max_lr``, ``min_lr``).
torch's state dict numbers the parameters group after group; each one's state (``step``,
``exp_avg``, ``exp_avg_sq``) has its parameter's shape. megart's groups split by the same rules
(megart.training.optimizer), so the groups match one to one; the order and the shapes
(SwiGLU's gate and up as one ``linear_fc1``) differ, and every state tensor goes through the
weights' own mapping (a scalar such as ``step`` broadcast to its parameter's shape, mapped, and
read back from one element).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.megatron_names import expert_bias_layer
from megart.training.megatron_mla import MLA_LINEARS
from megart.training.optimizer import group_index

# Megatron-Core's parameters of --decoupled-lr's group (is_embedding_or_output_parameter: the
# word embedding, the output layer and, on a tied model's last stage, the copy it holds there).
EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")

# One model chunk's state dict of parameter -> tensor: megart's names <-> Megatron-Core's.
ChunkMap = Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]

# The keys Megatron-Core's _get_param_groups adds to each group (default config, no overrides).
MEGATRON_GROUP_KEYS = (
    "is_expert_parallel",
    "default_config",
    "wd_mult",
    "lr_mult",
    "is_decoupled_lr",
    "max_lr",
    "min_lr",
)
# GPTModel's modules in the order they register their parameters (the local layer spec).
_LAYER_PARTS = (
    "input_layernorm",
    "self_attention.core_attention",  # --softmax-type learnable's softmax_offset (built first)
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    # Multi-latent attention's (in place of linear_qkv), in MLASelfAttention's order.
    *MLA_LINEARS,
    "self_attention.q_layernorm",  # --qk-layernorm's, built after linear_qkv (or MLA's)
    "self_attention.k_layernorm",
    "self_attention.kv_layernorm",  # MLA's latent norms: q_layernorm's, then this
    "pre_mlp_layernorm",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    # An MoE layer's (in place of the two above): its router, then each expert's fc1 and fc2,
    # then the shared experts' (SharedExpertMLP: its own gate_weight before its submodules').
    "mlp.router",
    "mlp.experts",
    "mlp.shared_experts",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
)
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
_SUFFIXES = ("weight", "bias", "_extra_state", "gate_weight", "softmax_offset")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)\.(\w+)$")
# A multi-token prediction depth's modules, in MultiTokenPredictionLayer's registration order.
_MTP_PARTS = ("enorm.", "hnorm.", "eh_proj.", "transformer_layer.", "final_layernorm.")
_MTP = re.compile(r"mtp\.layers\.(\d+)\.(" + "|".join(map(re.escape, _MTP_PARTS)) + r")(.+)$")


def _order_key(name: str) -> tuple:
    top = {
        "embedding.word_embeddings": 0,
        "embedding.position_embeddings": 1,
        "decoder.final_layernorm": 3,
        "output_layer": 4,
    }
    module, suffix = name.rsplit(".", 1)
    depth = _MTP.match(name)
    if depth:  # multi-token prediction's depths: after the decoder, before the output layer
        k, part, rest = depth.groups()
        if part == "transformer_layer.":  # its layer: ordered as a decoder layer's parts
            return (3, 1 + int(k), _MTP_PARTS.index(part), *_order_key("decoder.layers.0." + rest))
        return (3, 1 + int(k), _MTP_PARTS.index(part), 0, 0, 0, 0, 0, _SUFFIXES.index(rest))
    if module in top:
        return (top[module], 0, 0, 0, 0, _SUFFIXES.index(suffix))
    match = _LAYER.match(name)
    expert = match and _EXPERT.match(match.group(2))
    if not match or not (expert or match.group(2) in _LAYER_PARTS):
        raise KeyError(f"{name}: not a Megatron-Core GPTModel parameter megart writes")
    layer, part, suffix = match.groups()
    if expert:  # SequentialMLP's local experts in their order, each its fc1 then fc2
        e, fc = expert.groups()
        within = (int(e), fc == "linear_fc2")
        return (2, int(layer), _LAYER_PARTS.index("mlp.experts"), *within, _SUFFIXES.index(suffix))
    return (2, int(layer), _LAYER_PARTS.index(part), 0, 0, _SUFFIXES.index(suffix))


def in_megatron_order(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (Megatron-Core names of one model chunk) in the order GPTModel's
    ``state_dict()`` lists them, which is its ``named_parameters()`` order."""
    return {name: state[name] for name in sorted(state, key=_order_key)}


def decayed(name: str, tensor: torch.Tensor) -> bool:
    """Megatron-Core's default weight-decay rule: none on biases and 1-d parameters."""
    return not (tensor.dim() == 1 or name.endswith(".bias"))


def megatron_group_keys(
    lr: float, min_lr: float, decoupled: tuple[float, float] | None = None
) -> list[dict[str, Any]]:
    """Megatron-Core's keys of its default groups (decayed, then not), for --lr ``lr``; with
    ``decoupled`` (--decoupled-lr's peak and floor) the embedding's and output layer's group
    between them, as megatron-core 0.16.1 keys it (an override: not ``default_config``, and
    ``is_decoupled_lr`` left False)."""

    def keys(wd_mult: float, top: float, floor: float, default: bool) -> dict[str, Any]:
        return {
            "is_expert_parallel": False,
            "default_config": default,
            "wd_mult": wd_mult,
            "lr_mult": 1.0,
            "is_decoupled_lr": False,
            "max_lr": top,
            "min_lr": floor,
        }

    middle = [] if decoupled is None else [keys(1.0, *decoupled, default=False)]
    return [keys(1.0, lr, min_lr, True), *middle, keys(0.0, lr, min_lr, True)]


def is_decoupled(args: dict[str, Any]) -> bool:
    """Whether a file's optimizer has --decoupled-lr's group (its args: Megatron's or megart's)."""
    return args.get("decoupled_lr") is not None


def is_parameter(name: str, value: Any) -> bool:
    """Whether a Megatron-Core model state dict's entry is a parameter: not a layer's
    ``_extra_state``, nor a router's expert bias (a buffer: megatron_names.expert_bias_layer)."""
    return (
        isinstance(value, torch.Tensor)
        and not name.endswith("_extra_state")
        and expert_bias_layer(name) is None
    )


def param_groups_of(
    chunks: list[dict[str, Any]], decoupled: bool = False
) -> list[list[tuple[int, str]]]:
    """Megatron's param groups of a rank's model chunks (Megatron-Core names, in
    named_parameters order): (chunk, name) of each parameter, decayed ones first, with
    ``decoupled`` the embedding and output layer in a group of their own before the rest."""
    named = [
        (c, name, value)
        for c, chunk in enumerate(chunks)
        for name, value in chunk.items()
        if is_parameter(name, value)
    ]
    own = [(c, n) for c, n, _ in named if decoupled and n in EMBEDDING_OR_OUTPUT]
    return [
        [(c, n) for c, n, v in named if decayed(n, v) and (c, n) not in own],
        *([own] if decoupled else []),
        [(c, n) for c, n, v in named if not decayed(n, v)],
    ]


def megart_groups(
    model: list[dict[str, torch.Tensor]], decoupled: bool
) -> list[list[tuple[int, str]]]:
    """megart's param groups of its chunks (megart.training.optimizer.param_groups' rules)."""
    groups: list[list[tuple[int, str]]] = [[] for _ in range(3 if decoupled else 2)]
    for c, chunk in enumerate(model):
        for name, value in chunk.items():
            groups[group_index(name, value, decoupled)].append((c, name))
    return groups


def _map_states(
    states: list[dict[str, Any]],
    names: list[tuple[int, str]],
    shapes: list[dict[str, torch.Tensor]],
    chunk_map: ChunkMap,
) -> dict[tuple[int, str], dict[str, Any]]:
    """Per-parameter states (``states[i]`` of parameter ``names[i]``, shaped like
    ``shapes[c][name]``) mapped by ``chunk_map`` to the other side's (chunk, name)."""
    keys = {k for state in states for k in state}
    if any(set(state) != keys for state in states):
        raise ConfigError("the optimizer holds state for some parameters and not for others")
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for key in sorted(keys):
        per_chunk: list[dict[str, torch.Tensor]] = [{} for _ in shapes]
        scalar = False
        for (c, name), state in zip(names, states, strict=True):
            value = state[key]
            scalar = value.dim() == 0
            per_chunk[c][name] = value.expand(shapes[c][name].shape) if scalar else value
        for c, chunk in enumerate(per_chunk):
            for name, value in chunk_map(c, chunk).items():
                out.setdefault((c, name), {})[key] = (
                    value.reshape(-1)[0].clone() if scalar else value
                )
    return out


def to_megatron_optimizer(
    optimizer: dict[str, Any],
    params: list[tuple[int, str]],
    model: list[dict[str, torch.Tensor]],
    megatron_model: list[dict[str, Any]],
    chunk_map: ChunkMap,
    group_keys: list[dict[str, Any]],
) -> tuple[dict[str, Any], list[list[tuple[int, str]]]]:
    """megart's Adam state dict (``params``: the (chunk, name) of each of its parameters, in
    its numbering; ``model``: megart's chunks) as Megatron's non-distributed optimizer holds it
    for ``megatron_model`` (the same chunks under Megatron-Core's names, in its order);
    ``group_keys``: Megatron's keys of each group. Returns it and its groups' (chunk, name)."""
    if len(optimizer["param_groups"]) != len(group_keys):
        raise ConfigError(
            f"megart's optimizer has {len(optimizer['param_groups'])} param groups where "
            f"Megatron's have {len(group_keys)}"
        )
    ids = [i for group in optimizer["param_groups"] for i in group["params"]]
    states = [optimizer["state"].get(i, {}) for i in ids]
    mapped = _map_states(states, params, model, chunk_map) if any(states) else {}
    groups = param_groups_of(megatron_model, decoupled=len(group_keys) == 3)
    state, index, param_groups = {}, 0, []
    for ours, members, keys in zip(optimizer["param_groups"], groups, group_keys, strict=True):
        numbers = list(range(index, index + len(members)))
        state.update({i: mapped[p] for i, p in zip(numbers, members, strict=True) if p in mapped})
        index += len(members)
        hyper = {k: v for k, v in ours.items() if k != "params"}
        param_groups.append({**keys, **hyper, "params": numbers})
    return {"state": state, "param_groups": param_groups}, groups


def from_megatron_optimizer(
    optimizer: dict[str, Any],
    megatron_model: list[dict[str, Any]],
    model: list[dict[str, torch.Tensor]],
    chunk_map: ChunkMap,
    where: str,
    decoupled: bool = False,
) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """Megatron's non-distributed optimizer state dict of ``megatron_model`` (its chunks as
    the file holds them, in GPTModel's order) as megart's: its state dict and the (chunk,
    name) of each parameter in its numbering (``model``: megart's chunks, for the shapes).
    ``decoupled``: the file was saved with --decoupled-lr (its args say). A state that does
    not fit Megatron's param groups is refused, naming ``where``."""
    groups = param_groups_of(megatron_model, decoupled)
    saved = optimizer["param_groups"]
    sizes = [len(g["params"]) for g in saved]
    if sizes != [len(g) for g in groups]:
        kind = "--decoupled-lr's" if decoupled else "default"
        raise ConfigError(
            f"{where}: its optimizer has param groups of {sizes} parameters, but Megatron-Core's "
            f"{kind} groups of this model hold {[len(g) for g in groups]}: saved with other "
            "optimizer overrides, which megart does not have; resume with --no-load-optim"
        )
    ids = [i for g in saved for i in g["params"]]
    names = [p for g in groups for p in g]
    states = []
    for i, (c, name), group in zip(ids, names, [g for g in saved for _ in g["params"]],
                                   strict=True):  # fmt: skip
        state = dict(optimizer["state"].get(i, {}))
        if state and "step" not in state and "step" in group:
            state["step"] = torch.tensor(float(group["step"]))  # apex/TE FusedAdam: per group
        shape = megatron_model[c][name].shape
        if any(v.dim() and v.shape != shape for v in state.values() if torch.is_tensor(v)):
            raise ConfigError(
                f"{where}: the optimizer state of parameter {i} does not have the shape of "
                f"{name} {tuple(shape)}; resume with --no-load-optim"
            )
        states.append(state)
    mapped = _map_states(states, names, megatron_model, chunk_map) if any(states) else {}
    ours = megart_groups(model, decoupled)
    state, param_groups, index = {}, [], 0
    for members, group in zip(ours, saved, strict=True):
        numbers = list(range(index, index + len(members)))
        state.update({i: mapped[p] for i, p in zip(numbers, members, strict=True) if p in mapped})
        index += len(members)
        # megart's decoupled group keeps its peak and floor (what its step reads); Megatron's
        # other keys are rebuilt on writing.
        keep = ("max_lr", "min_lr") if group.get("default_config") is False else ()
        drop = {"params", "step", *MEGATRON_GROUP_KEYS} - set(keep)
        param_groups.append({**{k: v for k, v in group.items() if k not in drop},
                             "params": numbers})  # fmt: skip
    return {"state": state, "param_groups": param_groups}, [p for g in ours for p in g]
