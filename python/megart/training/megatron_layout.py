"""How Megatron-LM's legacy checkpoint (``--ckpt-format torch``) spreads a GPTModel's
Megatron-Core state dict over its model-parallel ranks, both ways: the whole model's tensors
split into each rank's, and each rank's merged back.

Each rank's file (``mp_rank_TT`` for one pipeline stage, ``mp_rank_TT_PPP`` otherwise) holds its
model chunks (``model``, or ``model0``, ``model1``, ... under interleaving), each the module state
dict of a GPTModel of its layers, numbered from 0 in every chunk: chunk c of pipeline rank r is
virtual stage c p + r and holds layers [s n, (s + 1) n), n = layers / (p v), as Megatron-Core's
transformer-layer offset places them (with uneven first/last stages, its placement of those:
megart.models.stages). The embeddings are on the first stage, the final norm and
output layer on the last; a tied output layer is a copy of the word embedding on the last stage
when that is not also the first (Megatron-Core allocates no weight where it reads the
embedding's). Across tensor parallelism, column-parallel weights and biases (``linear_qkv``,
``linear_fc1``, multi-latent attention's ``linear_q_proj``, ``linear_q_down_proj``,
``linear_q_up_proj``, ``linear_kv_down_proj`` and ``linear_kv_up_proj`` as Megatron-Core's local
spec builds them, the vocab rows of ``word_embeddings`` and ``output_layer``) are split on their
rows, row-parallel weights (``linear_proj``, ``linear_fc2``) on their columns, and the rest is
replicated, but for --softmax-type learnable's ``core_attention.softmax_offset`` (one logit per
head: split with the heads, on dim 0). SwiGLU's ``linear_fc1`` = [gate; up] is split per rank as
[gate_r; up_r].
"""

from __future__ import annotations

import re

import torch

from megart.errors import ConfigError
from megart.models import GPTConfig, chunk_layers
from megart.models.megatron_names import SINK as _SINK
from megart.models.megatron_names import is_fc1_halves
from megart.models.stages import uneven

Ranks = dict[tuple[int, int], list[dict[str, torch.Tensor]]]  # (tp rank, pp rank) -> chunks
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
_NORM = (".layer_norm_weight", ".layer_norm_bias")  # Transformer Engine's fused norms
WORD, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
SINK = "." + _SINK[1]  # --softmax-type learnable's per-head logits: split with the heads
# Column-parallel layers: q/k/v, fc1, multi-latent attention's projections (the local
# spec's: its down-projections too, their outputs gathered) and multi-token prediction's eh_proj.
_COLUMN = (
    r"\.(linear_qkv|linear_fc1|linear_q_proj|linear_q_down_proj|linear_q_up_proj"
    r"|linear_kv_down_proj|linear_kv_up_proj|eh_proj)\.(weight|bias)$"
)


def tp_dim(name: str) -> int | None:
    """The dimension Megatron-Core's tensor-parallel layers split parameter ``name`` along;
    None for replicated ones."""
    if name.endswith(_NORM):
        return None
    if name in (WORD, OUTPUT) or re.search(_COLUMN, name) or name.endswith(SINK):
        return 0
    if re.search(r"\.(linear_proj|linear_fc2)\.weight$", name):
        return 1
    return None


def shard(name: str, whole: torch.Tensor, cfg: GPTConfig, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s piece of parameter ``name`` among ``tp`` ranks."""
    dim = tp_dim(name)
    if dim is None:
        return whole
    if is_fc1_halves(name, cfg):
        gate, up = whole.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return whole.chunk(tp, dim)[rank]


def unshard(name: str, parts: list[torch.Tensor], cfg: GPTConfig) -> torch.Tensor:
    """Parameter ``name``'s whole tensor from its pieces in tensor-parallel rank order (the
    inverse of shard)."""
    dim = tp_dim(name)
    if dim is None:
        return parts[0]
    if is_fc1_halves(name, cfg):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(parts, dim)


def with_extra_states(state: dict[str, torch.Tensor], last: bool) -> dict:
    """``state`` with the ``_extra_state`` entry (None) that each of Megatron-Core's linear
    layers adds to a module state dict (the output layer's on the last stage even when tied),
    so that Megatron's strict load finds every key; the local spec's layers hold None there,
    and Transformer Engine's take None as nothing to restore."""
    linears = {
        n.rsplit(".", 1)[0] for n in state if re.search(r"\.(linear_\w+|eh_proj)\.weight$", n)
    }
    if last:
        linears.add("output_layer")
    return state | {f"{prefix}._extra_state": None for prefix in sorted(linears)}


def _stage_layers(
    cfg: GPTConfig, pp: int, vpp: int, first: int | None, last: int | None
) -> dict[tuple[int, int], range]:
    if uneven(first, last):
        cfg.check_layout(pp=pp, chunks=vpp, first=first, last=last)
    elif cfg.num_layers % (pp * vpp):
        raise ConfigError(
            f"{cfg.num_layers} layers do not split evenly over pipeline-parallel {pp} x "
            f"{vpp} virtual stages; pick sizes that divide --num-layers"
        )
    return {
        (p, c): layers
        for p in range(pp)
        for c, layers in enumerate(chunk_layers(cfg.num_layers, p, pp, vpp, first=first, last=last))
    }


def split(
    whole: dict[str, torch.Tensor],
    cfg: GPTConfig,
    tp: int,
    pp: int,
    vpp: int = 1,
    first: int | None = None,
    last: int | None = None,
) -> Ranks:
    """Each rank's chunks of the whole model's Megatron-Core state dict ``whole`` (the word
    embedding and output layer already padded to the vocabulary of ``tp`` ranks); ``first``/
    ``last``: uneven first/last stages' layers (--decoder-first/last-pipeline-num-layers)."""
    stages = pp * vpp
    out: Ranks = {}
    for (p, c), layers in _stage_layers(cfg, pp, vpp, first, last).items():
        vs = c * pp + p
        first, last = vs == 0, vs == stages - 1
        for t in range(tp):
            state: dict[str, torch.Tensor] = {}
            for name, value in whole.items():
                match = _LAYER.match(name)
                if match:
                    layer = int(match.group(1))
                    if layer not in layers:
                        continue
                    local = f"decoder.layers.{layer - layers.start}.{match.group(2)}"
                elif not (first if name.startswith("embedding.") else last):
                    continue
                else:
                    local = name
                state[local] = shard(name, value, cfg, tp, t).clone()
            if last and not first and not cfg.untie_embeddings_and_output_weights:
                state[OUTPUT] = shard(WORD, whole[WORD], cfg, tp, t).clone()
            out.setdefault((t, p), []).append(with_extra_states(state, last))
    return out


def merge(
    ranks: Ranks,
    cfg: GPTConfig,
    tp: int,
    pp: int,
    first: int | None = None,
    last: int | None = None,
) -> dict[str, torch.Tensor]:
    """The whole model's Megatron-Core state dict from every rank's chunks (the inverse of
    split); ``_extra_state`` entries and a tied output layer's copy are dropped."""
    vpp = len(ranks[0, 0])
    whole: dict[str, torch.Tensor] = {}
    for (p, c), layers in _stage_layers(cfg, pp, vpp, first, last).items():
        states = [ranks[t, p][c] for t in range(tp)]
        names = [n for n in states[0] if not n.endswith("_extra_state")]
        for t, state in enumerate(states[1:], 1):
            if set(names) - set(state):
                raise ConfigError(
                    f"tensor rank {t}, pipeline rank {p}, chunk {c} lacks "
                    f"{sorted(set(names) - set(state))} that tensor rank 0 holds"
                )
        for name in names:
            if name == OUTPUT and not cfg.untie_embeddings_and_output_weights:
                continue
            match = _LAYER.match(name)
            if match:
                local = int(match.group(1))
                if local >= len(layers):
                    raise ConfigError(
                        f"pipeline rank {p}, chunk {c} holds layer {local}, but {cfg.num_layers} "
                        f"layers over {pp} x {vpp} stages leave it {len(layers)}"
                    )
                name_whole = f"decoder.layers.{layers.start + local}.{match.group(2)}"
            else:
                name_whole = name
            whole[name_whole] = unshard(name, [s[name] for s in states], cfg)
    return whole
