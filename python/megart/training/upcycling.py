"""--moe-use-upcycling: an MoE run started from a dense checkpoint, as Megatron-LM does it.

Megatron-LM (training.py's setup, megatron/core/transformer/moe/upcycling_utils.py) builds the
dense model the MoE flags describe without experts (--num-experts unset, expert-parallel 1,
--ffn-hidden-size x --moe-upcycling-granularity), loads --load's checkpoint into it (weights
only: its validate_args turns on --no-load-optim and --no-load-rng; the checkpoint's iteration
is dropped), and gives the MoE model every weight of the same name. Each MoE layer's experts
are the dense MLP's: with a granularity G of dense ffn / --moe-ffn-hidden-size (G divides the
experts), expert e holds slice e mod G of the dense MLP's width (fc and gate rows, proj
columns; SwiGLU's gate and up halves sliced alike), fc, gate and proj times a factor s (below);
proj's bias is whole and unscaled. The router keeps its fresh draw, with G > 1 its first E/G
rows each repeated G times (expert e takes row e // G). Shared experts keep their fresh draw.

    s = a ** (1/3) with SwiGLU or --squared-relu, else a ** (1/2), where
    a = E x G / top-k with --moe-router-pre-softmax, else a = G.

It then saves the MoE model to --save as iteration 1 (weights and random streams, no optimizer
state) and trains on from iteration 1 with a fresh optimizer and learning-rate schedule.

Where the first forward equals the dense model's: G = 1 without --moe-router-pre-softmax,
softmax scores and --moe-router-topk-scaling-factor 1 (or none) and no shared experts: every
token's top-k weights sum to 1 over identical experts. With G > 1 also (top-k = G) under
--squared-relu (s**3 = G undoes the 1/G weights: the activation is homogeneous), not under GeLU
or SwiGLU, which Megatron scales only approximately.

Where megart differs: Megatron-LM's upcycled run keeps the dense checkpoint's consumed samples
(its data position) while its schedule restarts; megart's schedule follows the consumed samples,
so they restart at 0 with it, and the data is iteration 1's (megart's data is a function of the
iteration). The dense checkpoint may be megart's or Megatron-LM's (legacy or torch_dist), of
any tensor/pipeline layout: it is read into this run's layout (megart.training.checkpoint.load).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch

import megart.distributed as dist
from megart.errors import ConfigError
from megart.tensor_parallel.random import GeneratorStates
from megart.training import checkpoint, checkpoint_dirs
from megart.training.optimizer import full_precision
from megart.training.shards import split_shard
from megart.training.upcycling_checks import Rule

# An MoE layer's router or expert: a decoder layer's, or a multi-token prediction depth's
# (upcycled alike, as Megatron-Core's upcycling converts every layer's MLP by its names' ends).
_EXPERT = re.compile(
    r"(blocks\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\."
    r"(router\.weight|experts\.(\d+)\.(\w+)\.(weight|bias))$"
)


def upcycled_layer(dense: dict[str, torch.Tensor], router: torch.Tensor, rule: Rule) -> dict:
    """One MoE layer's whole tensors from the dense MLP's whole tensors ``dense`` (``fc.weight``,
    ``gate.weight``, ``proj.weight`` and their biases, as megart names them) and the router's
    fresh whole weight: ``router.weight`` and ``experts.{e}.{part}`` for every expert e."""
    g = rule.granularity
    out = {"router.weight": router[: rule.num_experts // g].repeat_interleave(g, dim=0)}
    for e in range(rule.num_experts):
        s = e % g  # Megatron's list of the G slices, repeated E/G times
        for name, whole in dense.items():
            part = name.split(".")[0]
            if name == "proj.bias":  # added once by weights summing to 1: whole, unscaled
                value = whole
            elif part == "proj":  # row-parallel: the slice of its input columns
                value = whole.tensor_split(g, dim=1)[s] * rule.scale
            else:  # fc, gate (weights and biases): the slice of their output rows
                value = whole.tensor_split(g, dim=0)[s] * rule.scale
            out[f"experts.{e}.{name}"] = value.clone()
    return out


def dense_config(config: Any) -> Any:
    """The flags of the dense model (Megatron's: no experts, expert-parallel 1, --ffn-hidden-size
    x the granularity), read as weights only, in fp32 whatever --half-weights says."""
    dense = copy.copy(config)  # not dataclasses.replace: the flags are resolved already
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name in defaults:  # the MoE fields as a run without experts has them
        if name.startswith("moe_") and not name.startswith(("moe_use_", "moe_upcycling_")):
            setattr(dense, name, defaults[name])
    dense.num_experts, dense.expert_model_parallel_size = None, 1
    g = config.moe_upcycling_granularity
    if g > 1:
        dense.ffn_hidden_size = config.gpt_config().ffn_size * g
    dense.finetune, dense.half_weights = True, False
    return dense


def source(config: Any) -> str:
    """The dense checkpoint's directory: --load's, or --pretrained-checkpoint's where --load
    holds none (Megatron's load_checkpoint)."""
    if config.load and not checkpoint_dirs.no_checkpoint_yet(config.load):
        return config.load
    pretrained = config.pretrained_checkpoint
    if pretrained and not checkpoint_dirs.no_checkpoint_yet(pretrained):
        return pretrained
    where = " nor ".join(d for d in (config.load, pretrained) if d)
    raise ConfigError(f"--moe-use-upcycling: {where} holds no dense checkpoint to upcycle")


def start(
    config: Any, grid: Any, chunks: list, optimizer: Any, rng: Any, scaler: Any, build: Callable
) -> tuple[int, int]:
    """Loads the dense checkpoint into ``chunks`` (the MoE model, this rank's), saves them to
    --save as iteration 1 and returns where training goes on: iteration 1, 0 samples.
    ``build``: trainer_setup.model_chunks (passed in: that module calls this one)."""
    if not checkpoint_dirs.no_checkpoint_yet(config.save):
        raise ConfigError(
            f"--moe-use-upcycling: --save {config.save} holds a checkpoint already; upcycling is "
            "for the first run only (Megatron-LM's rule): resume without the flag"
        )
    directory, dense = source(config), dense_config(config)
    plain = dataclasses.replace(grid, ep_group=None, edp_group=None)  # the dense files' layout
    states, streams = GeneratorStates.current(), rng.get_states()
    device = next(chunks[0].parameters()).device
    dense_chunks = build(dense, dense.gpt_config(), plain, rng, device)
    GeneratorStates(states.cpu, states.cuda).install()  # the MoE run's streams, undisturbed
    rng.set_states(streams)
    checkpoint.load(directory, dense, plain, dense_chunks, None, rng, None)
    rule = Rule.of(chunks[0].cfg, dense_chunks[0].cfg.ffn_size)
    with full_precision(optimizer), torch.no_grad():
        for moe, plain_chunk in zip(chunks, dense_chunks, strict=True):
            fill(moe, plain_chunk, rule, grid.tp_group)
    if dist.get_rank() == 0:
        print(
            f"megart train: upcycled the dense checkpoint in {directory} into {rule.num_experts} "
            f"experts (granularity {rule.granularity}); saving it to {config.save} as "
            "iteration 1",
            flush=True,
        )
    saving = copy.copy(config)
    saving.no_save_optim = True  # Megatron saves the upcycled model without an optimizer
    with full_precision(optimizer):
        checkpoint.save(config.save, 1, saving, grid, chunks, optimizer, rng, scaler, 0)
    return 1, 0


def fill(moe: torch.nn.Module, dense: torch.nn.Module, rule: Rule, tp_group: Any) -> None:
    """``moe``'s parameters (one chunk of this rank) from the same layers of the dense chunk:
    the same weights where names match, the experts and router by upcycled_layer; shared
    experts keep their draw."""
    held = dict(dense.named_parameters())
    layers: dict[str, dict] = {}
    for name, p in moe.named_parameters():
        match = _EXPERT.search(name)
        if match is None:
            if ".shared_experts." not in name and ".shared_expert_gate." not in name:
                p.copy_(held[name])
            continue
        prefix = name[: match.start(2)]
        if prefix not in layers:
            layers[prefix] = _whole_layer(moe, dense, prefix, rule, tp_group)
        whole = layers[prefix][match.group(2)]
        t = 1 if tp_group is None else tp_group.size()
        rank = 0 if tp_group is None else tp_group.rank()
        p.copy_(split_shard(whole, getattr(p, "partition_dim", None), t, rank))


def _whole_layer(
    moe: torch.nn.Module, dense: torch.nn.Module, prefix: str, rule: Rule, group: Any
) -> dict:
    """The upcycled whole tensors of the MoE layer at ``prefix`` (``blocks.N.mlp.``, or a
    depth's ``mtp.layers.K.transformer_layer.mlp.``)."""
    mlp = dense.get_submodule(prefix.rstrip("."))
    parts = {n: _gathered(p, group) for n, p in mlp.named_parameters()}
    router = _gathered(moe.get_submodule(prefix + "router").weight, group)
    return upcycled_layer(parts, router, rule)


def _gathered(p: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole of tensor-parallel parameter ``p`` (itself where it is not split)."""
    dim = getattr(p, "partition_dim", None)
    t = 1 if group is None else group.size()
    if dim is None or t == 1:
        return p.detach()
    shard = p.detach().movedim(dim, 0).contiguous()
    out = torch.empty((t * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=p.device)
    dist.all_gather_into_tensor(out.view(-1), shard.view(-1), group=group)
    return out.movedim(0, dim)
