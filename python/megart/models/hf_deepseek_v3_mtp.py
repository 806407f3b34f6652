"""DeepSeek-V3's multi-token prediction layers in its Hugging Face files (megart.models.mtp's
depths, --mtp-num-layers = num_nextn_predict_layers).

DeepSeek-V3's released weights hold depth k (0-based) as one more decoder layer after the last,
``model.layers.{L + k}`` (L = num_hidden_layers): its ``enorm``, ``hnorm`` and ``eh_proj``, the
usual attention and MLP weights of a decoder layer (megart's depth's transformer_layer), and a
``shared_head`` whose ``norm`` normalises the depth's output before the output layer (megart's
final_layernorm). Its ``embed_tokens`` and ``shared_head.head`` are copies of the main model's
embedding and output layer (DeepSeek-V3's technical report: the depths share them), which megart
(as Megatron-Core) shares outright: read, each copy must equal the main tensor, and is refused by
name where it does not; written, each is the main tensor again. eh_proj's first h columns take
the depth's normed embedding, the last h the normed hidden states: the report writes
M[RMSNorm(h); RMSNorm(Emb)], but the engines that serve the released weights (vLLM's
deepseek_mtp, SGLang's deepseek_nextn) and transformers' MtpLayer concatenate enorm(embedding)
first, as Megatron-Core and megart do, so the columns map as they are. The next depth takes
the previous one's output after its final norm (transformers' MtpModel, Megatron-Core).

transformers' DeepseekV3ForCausalLM does not build these layers (it leaves ``model.layers.61.*``
unread) and its save_pretrained drops them while its config still says num_nextn_predict_layers
(1 by default): config.json alone cannot tell, so the files decide (fit_files).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection

import torch

from megart.errors import ConfigError
from megart.models.config import GPTConfig

NAME = "DeepSeek-V3"
# A depth's own weights beside its decoder layer: megart's names -> DeepSeek-V3's.
OWN = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
       ("final_layernorm", "shared_head.norm"))  # fmt: skip
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def depth_names(
    cfg: GPTConfig, layer_names: Callable[[GPTConfig, int], list[tuple[str, str]]]
) -> list[tuple[str, str]]:
    """Every depth's (megart, DeepSeek-V3) tensor names; ``layer_names(cfg, i)`` names decoder
    layer i's (``chunk.blocks.i.`` for megart), here asked for the layers after the last, whose
    kind GPTConfig.is_moe_layer gives as megart builds the depths (the last decoder layer's)."""
    pairs = []
    for k in range(cfg.mtp_num_layers or 0):
        i = cfg.num_layers + k
        ours, theirs = f"chunk.mtp.layers.{k}.", f"model.layers.{i}."
        pairs += [(f"{ours}{m}.weight", f"{theirs}{h}.weight") for m, h in OWN]
        block = f"chunk.blocks.{i}."
        pairs += [
            (ours + "transformer_layer." + m.removeprefix(block), h) for m, h in layer_names(cfg, i)
        ]
    return pairs


def shared_copies(cfg: GPTConfig) -> list[tuple[str, str]]:
    """(megart's shared tensor, DeepSeek-V3's copy of it in each depth's layer)."""
    head = "chunk.output_layer.weight" if cfg.untie_embeddings_and_output_weights else None
    pairs = []
    for k in range(cfg.mtp_num_layers or 0):
        layer = f"model.layers.{cfg.num_layers + k}."
        pairs.append(("chunk.wte.weight", layer + "embed_tokens.weight"))
        pairs.append((head or "chunk.wte.weight", layer + "shared_head.head.weight"))
    return pairs


def check_shared(cfg: GPTConfig, take: Callable[[str], torch.Tensor]) -> None:
    """Refuses by name a depth's embedding or head copy that is not the main model's tensor
    (a copy a file leaves out is shared by construction)."""
    main = {
        "chunk.wte.weight": "model.embed_tokens.weight",
        "chunk.output_layer.weight": "lm_head.weight",
    }
    read: dict[str, torch.Tensor] = {}  # each main tensor read once, however many depths
    for ours, copy in shared_copies(cfg):
        try:
            theirs = take(copy)
        except ConfigError:
            continue
        if ours not in read:
            read[ours] = take(main[ours])
        shared = read[ours]
        if theirs.shape != shared.shape or not torch.equal(theirs, shared):
            off = "another shape" if theirs.shape != shared.shape else (
                f"by up to {(theirs - shared).abs().max().item():.3g}"
            )  # fmt: skip
            raise ConfigError(
                f"this {NAME}'s {copy} differs from {main[ours]} ({off}): megart's "
                "multi-token prediction depths share the main model's embedding and output "
                "layer (as Megatron-Core's do), so it cannot hold a depth with its own"
            )


def fit_files(cfg: GPTConfig, stored: Collection[str]) -> tuple[GPTConfig, str | None]:
    """``cfg`` (config.json's reading) as the files' tensor names ``stored`` hold it, and the
    note to give once where that differs: no depth's layer in the files (transformers'
    save_pretrained drops them) is the model without multi-token prediction. A part of the
    depths, or a depth's layer of another kind (experts or not) than megart builds, is
    refused by name."""
    depths = cfg.mtp_num_layers or 0
    if not depths:
        return cfg, None
    first = cfg.num_layers
    layers = {int(m.group(1)) for name in stored if (m := _LAYER.match(name))}
    held = [i for i in range(first, first + depths) if i in layers]
    if not held:
        note = (
            f"this {NAME}'s config.json says num_nextn_predict_layers {depths} but its files "
            f"hold no layer {first} (transformers' save_pretrained leaves the multi-token "
            "prediction layers out): megart takes the model without them (no --mtp-num-layers)"
        )
        return dataclasses.replace(cfg, mtp_num_layers=None), note
    if len(held) < depths:
        raise ConfigError(
            f"this {NAME} has num_nextn_predict_layers {depths} but its files hold only layers "
            f"{held} of {list(range(first, first + depths))}: give the files of every "
            "multi-token prediction layer, or set num_nextn_predict_layers to 0 to take the "
            "model without them"
        )
    for i in held:
        experts = f"model.layers.{i}.mlp.gate.weight" in stored
        if experts != cfg.is_moe_layer(i):
            kinds = ("dense", "with experts")
            raise ConfigError(
                f"this {NAME}'s multi-token prediction layer {i} is {kinds[experts]} where its "
                f"last decoder layer is {kinds[not experts]}: megart's depths (as "
                "Megatron-Core's) are layers of the last decoder layer's kind"
            )
    return cfg, None


def check_depths(cfg: GPTConfig) -> None:
    """Refuses depths a DeepSeek-V3 checkpoint would be read back wrong with: dense ones
    (transformers' MtpModel builds every multi-token prediction layer with experts)."""
    if cfg.mtp_num_layers and not cfg.is_moe_layer(cfg.num_layers):
        raise ConfigError(
            f"a {NAME} checkpoint cannot represent --mtp-num-layers {cfg.mtp_num_layers} "
            "with a dense last layer (megart's depths take its kind; transformers' MtpModel "
            f"builds a {NAME}'s multi-token prediction layers with experts whatever "
            "first_k_dense_replace says): give the last layer experts, or keep the model in "
            "megart's checkpoint format"
        )


def bias_layer(cfg: GPTConfig, name: str) -> int:
    """The layer number (the depths' after the decoder's, as megart's checkpoints keep their
    expert_bias rows) of an expert bias named ``chunk.blocks.i.mlp.router.expert_bias`` or
    ``chunk.mtp.layers.k.transformer_layer.mlp.router.expert_bias``."""
    parts = name.split(".")
    if parts[1] == "mtp":
        return cfg.num_layers + int(parts[3])
    return int(parts[2])
