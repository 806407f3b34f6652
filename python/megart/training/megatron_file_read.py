"""Reading one rank's file of Megatron-LM's legacy checkpoint (``--ckpt-format torch``, its
layout in megart.training.megatron_files) as megart's (checkpoint.file_state's keys): a file
megart train wrote (its record under ``megart``) or one Megatron-LM wrote (the non-distributed
optimizer's, or the distributed one's once megart.training.megatron_distrib_optim joined it):
the model, Megatron's optimizer state in megart's order, the RNG, loss scaler and scheduler.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.config import GPTConfig
from megart.models.megatron_names import expert_bias_layer, from_megatron
from megart.training import megatron_expert_files as experts
from megart.training import tokenizer_record
from megart.training.megatron_args import (
    args_record,
    check_args,
    config_from_args,
)
from megart.training.megatron_files import from_grad_scaler, megatron_layer_ids, model_chunks
from megart.training.megatron_layout import OUTPUT
from megart.training.megatron_optimizer import (
    from_megatron_optimizer,
    is_decoupled,
    megart_groups,
    param_groups_of,
)


def _chunk_from_megatron(sd: dict[str, torch.Tensor], cfg: GPTConfig, first: bool) -> dict:
    out = from_megatron(sd, cfg)
    if not first and not cfg.untie_embeddings_and_output_weights and OUTPUT in sd:
        out["wte.weight"] = out.pop("output_layer.weight")
    return out


# The key of a file state whose expert_bias rows hold only its own layers' (a file Megatron-LM
# wrote: each rank file has its stage's routers, megart's own files every layer's).
PARTIAL_BIAS = "expert_bias_partial"


def _without_expert_bias(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sd.items() if expert_bias_layer(k) is None}


def file_expert_bias(
    chunks: list[dict[str, Any]], layer_ids: list[list[int]], cfg: GPTConfig
) -> torch.Tensor | None:
    """The expert biases a Megatron-LM rank file's ``chunks`` hold, as
    models.moe_router.expert_bias_rows' [layers, E] fp32 rows (zero for the layers elsewhere),
    each chunk's local layer j the model's layer ``layer_ids[c][j]``; None without them."""
    if cfg.num_experts is None or not cfg.moe_router_enable_expert_bias:
        return None
    rows = torch.zeros(cfg.num_layers + (cfg.mtp_num_layers or 0), cfg.num_experts)
    for sd, ids in zip(chunks, layer_ids, strict=True):
        for key, value in sd.items():
            layer = expert_bias_layer(key, cfg.num_layers)
            if key.startswith("mtp."):  # a depth's: numbered after the decoder's layers
                rows[layer] = value.float()
            elif layer is not None:
                rows[ids[layer]] = value.float()
    return rows


def _megatron_written(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """What megart keeps under ``megart`` in its own files, for a file Megatron-LM wrote: the
    model and layout from its args, the layers from the file's place, the loss scale."""
    a = vars(state["args"])
    check_args(a, path)
    chunks = len(model_chunks(state))
    ep = a.get("expert_model_parallel_size") or 1
    _, p, _ = experts.file_place(path, a.get("pipeline_model_parallel_size") or 1, ep)
    optimizer = state.get("optimizer")
    if isinstance(optimizer, list) and (ep == 1 or len(optimizer) != 2):
        raise ConfigError(
            f"{path}: its optimizer is a chain of {len(optimizer)} (at expert-parallel size "
            f"{ep}; megart reads the chain of two that expert parallelism makes, not "
            "--overlap-param-gather-with-optimizer-step's or other overrides')"
        )
    first = optimizer[0] if isinstance(optimizer, list) else optimizer
    scaler = first.get("grad_scaler") if isinstance(first, dict) else None
    rank_layers = megatron_layer_ids(a, p, chunks)
    record = args_record(a)
    if ep > 1:  # as megart's own expert-parallel files record it
        record["config"] = {**record["config"], "expert_model_parallel_size": ep}
    return {
        # Weights alone (as convert-checkpoint writes them): loaded as --finetune loads them.
        "release": optimizer is None,
        **record,
        "layer_ids": rank_layers,
        # Megatron's ConstantGradScaler (--loss-scale) saves an empty dict: the scale is the
        # flag's, and a dynamic run starts its own.
        "loss_scaler": from_grad_scaler(scaler) if scaler else None,
        "rng_tracker": None,  # Megatron's are CUDA streams: this run keeps its own
        "half": isinstance(first, dict) and "fp32_from_fp16_params" in first,
        "optimizer_layout": "megatron",
        "opt_param_scheduler": state.get("opt_param_scheduler"),
        # This stage's routers' alone: a load under another layout gathers the other stages'
        # (megatron_expert_bias.gathered).
        "expert_bias": file_expert_bias(model_chunks(state), rank_layers, config_from_args(a)),
        PARTIAL_BIAS: True,
    }


def from_megatron_file(state: dict[str, Any], path: Any) -> dict[str, Any]:
    """megart's view (checkpoint.file_state's keys) of a file in Megatron-LM's legacy layout,
    written by megart train or by Megatron-LM (non-distributed optimizer)."""
    extra = state.get("megart")
    if extra is None:
        extra = _megatron_written(state, Path(path))
    known = {f.name for f in dataclasses.fields(GPTConfig) if f.init}
    cfg = GPTConfig(**{k: v for k, v in extra["model_config"].items() if k in known})
    firsts = [ids[0] == 0 for ids in extra["layer_ids"]]
    # Not parameters: the routers' expert bias comes from megart's record (every layer's) or,
    # in Megatron-LM's own files, from the chunks' buffers (_megatron_written's rows).
    saved = [_without_expert_bias(sd) for sd in model_chunks(state)]
    model = [_chunk_from_megatron(sd, cfg, f) for sd, f in zip(saved, firsts, strict=True)]
    optimizer = state.get("optimizer")
    decoupled = is_decoupled(vars(state["args"]))
    params: list[tuple[int, str]] = []
    if isinstance(optimizer, list):  # expert parallelism's chain: dense, then the experts'
        parts = [
            _from_megatron_optimizer(
                sub,
                experts.split_model(saved, part, megatron=True),
                model,
                cfg,
                firsts,
                extra,
                path,
                decoupled,
                part,
            )
            for sub, part in zip(optimizer, (False, True), strict=True)
        ]
        optimizer, params = experts.joined_optimizer(parts, megart_groups(model, decoupled))
    elif optimizer is not None:
        optimizer, params = _from_megatron_optimizer(
            optimizer, saved, model, cfg, firsts, extra, path, decoupled
        )
    rng = None
    if state.get("rng_state"):
        r = state["rng_state"][0]
        rng = {"torch": r["torch_rng_state"], "cuda": r.get("cuda_rng_state"),
               "tracker": extra["rng_tracker"], "python": r.get("random_rng_state"),
               "numpy": r.get("np_rng_state")}  # fmt: skip
    a = vars(state["args"])
    ep = a.get("expert_model_parallel_size") or 1
    if ep > 1:  # its experts' local numbers as the model's
        _, _, e = experts.file_place(path, a.get("pipeline_model_parallel_size") or 1, ep)
        shift = experts.first_expert(e, ep, cfg.num_experts)
        model = experts.shifted({"model": model}, shift)["model"]
        params = [(c, experts.shift_name(n, shift)) for c, n in params]
    return {
        "iteration": state["iteration"],
        "consumed_train_samples": getattr(state["args"], "consumed_train_samples", None),
        "release": extra["release"],
        "config": extra["config"],
        "model_config": extra["model_config"],
        "layer_ids": extra["layer_ids"],
        "optimizer_params": params,
        "model": model,
        "optimizer": optimizer,
        "rng": rng,
        "loss_scaler": extra["loss_scaler"],
        # The file's own, whoever wrote it (megart's record beside Megatron's keys has none).
        "opt_param_scheduler": state.get("opt_param_scheduler"),
        "tokenizer": tokenizer_record.record(vars(state["args"])),  # as Megatron's args say
        "expert_bias": extra.get("expert_bias"),
        PARTIAL_BIAS: bool(extra.get(PARTIAL_BIAS)),
    }


def _from_megatron_optimizer(
    optimizer: dict[str, Any],
    saved: list[dict[str, Any]],
    model: list[dict[str, torch.Tensor]],
    cfg: GPTConfig,
    firsts: list[bool],
    extra: dict[str, Any],
    path: Any,
    decoupled: bool,
    experts_part: bool | None = None,
) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """megart's Adam state dict and parameter names of one Megatron optimizer's state dict over
    the Megatron chunks ``saved`` (with 16-bit weights, its fp32 masters are put into megart's
    ``model``); ``experts_part``: one optimizer of expert parallelism's chain (the experts'
    with True), which covers those parameters of ``model`` only."""

    def back(c: int, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _chunk_from_megatron(sd, cfg, firsts[c])

    params = extra.get("optimizer_params", [])
    if extra["half"]:
        if extra.get("optimizer_layout") == "megatron":
            masters: list[dict[str, torch.Tensor]] = [{} for _ in saved]
            groups = param_groups_of(saved, decoupled)
            if experts_part is not None:  # it leaves out the groups no rank's experts fill
                groups = experts.saved_groups(groups, optimizer["optimizer"])
            for group, tensors in zip(groups, optimizer["fp32_from_fp16_params"], strict=True):
                for (c, name), master in zip(group, tensors, strict=True):
                    masters[c][name] = master
            for c, chunk in enumerate(masters):
                model[c].update(back(c, chunk))
        else:  # written before megart wrote Megatron's layout: masters in megart's order
            names = iter(params)
            for group in optimizer["fp32_from_fp16_params"]:
                for master in group:
                    c, n = next(names)
                    model[c][n] = master
        optimizer = optimizer["optimizer"]
    if extra.get("optimizer_layout") != "megatron":
        return optimizer, params
    part = model
    if experts_part is not None:
        part = experts.split_model(model, experts_part, megatron=False)
        sizes = [len(g) for g in megart_groups(part, decoupled)]
        optimizer = experts.with_groups_of(optimizer, sizes)
    return from_megatron_optimizer(optimizer, saved, part, back, str(path), decoupled)
