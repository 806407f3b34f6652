"""Offline conversion between megart checkpoints and Megatron-LM's checkpoints, legacy
(``--ckpt-format torch``) or distributed (``torch_dist``, see megart.training.megatron_dist):
the weights, under Megatron-Core's GPTModel names.

    megart convert-checkpoint --from megart --to megatron --load ckpt --save megatron-ckpt \
        [--ckpt-format torch_dist]
    megart convert-checkpoint --from megatron --to megart --load megatron-ckpt --save ckpt

Megatron's files (``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt``, one per tensor- and
pipeline-parallel rank) hold ``args`` (an argparse Namespace of its flags),
``checkpoint_version`` 3.0, ``iteration`` and ``model`` (``model0``, ``model1``, ... under
interleaving): each rank's shards, laid out as megart.training.megatron_layout says. Written:
the source checkpoint's layout or the one asked for, the weights only (load it with
--finetune, or --no-load-optim --no-load-rng). Read: any layout, merged and written as a megart
release checkpoint (weights only, --load under any megart layout reshards it, as after
import-hf). The routers' expert biases (--moe-router-enable-expert-bias), buffers beside the
weights, go both ways too: Megatron-Core's ``mlp.router.expert_bias`` of each MoE layer, megart's
rows of every layer (megatron_expert_bias).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.models.config import GPTConfig
from megart.models.megatron_names import from_megatron, to_megatron
from megart.models.mtp_checks import refuse_mtp
from megart.models.stages import check_stages, ends_of, uneven
from megart.models.vocab import fit_vocab
from megart.training import megatron_dist, megatron_expert_bias, megatron_layout, tokenizer_record
from megart.training.checkpoint import (
    FILE,
    TRACKER,
    iteration_dir,
    model_config,
    rank_dir,
    required_latest_iteration,
    write_release,
)
from megart.training.checkpoint_save import replace_text
from megart.training.ckpt_files import expert_rank_files
from megart.training.megatron_args import (
    check_args,
    config_from_args,
    megatron_args,
    saved_stages,
)
from megart.training.megatron_expert_files import merged_megatron_chunks
from megart.training.megatron_files import model_chunks, rank_state, torch_load
from megart.training.megatron_mla import refuse_mla_yarn
from megart.training.shards import layer_ids, read_shards, whole_tensors

VOCAB_NAMES = (megatron_layout.WORD, megatron_layout.OUTPUT)


def megart_to_megatron(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    tp: int | None = None,
    pp: int | None = None,
    ckpt_format: str = "torch",
    first: int | None = None,
    last: int | None = None,
    vpp: int | None = None,
) -> list[Path]:
    """The latest checkpoint in megart's ``load_dir`` (any layout) as Megatron-LM's checkpoint
    in ``save_dir``, in ``ckpt_format`` (``torch``, legacy, or ``torch_dist``), for ``tp`` x
    ``pp`` ranks (by default the source's layout, interleaving and uneven stages included);
    ``first``/``last``: the layers of the first/last pipeline stage written (Megatron-LM's
    --decoder-first/last-pipeline-num-layers; given, they replace the source's split; torch_dist
    stores only record them in args); ``vpp``: the model chunks (virtual stages) of each
    pipeline rank written, Megatron-LM's interleaving (given, it replaces the source's).
    Returns its files (torch_dist: its iteration directory)."""
    if ckpt_format not in ("torch", "torch_dist"):
        raise ConfigError(f"--ckpt-format {ckpt_format}: give torch or torch_dist")
    for flag, size in (("tensor", tp), ("pipeline", pp)):
        if size is not None and size < 1:
            raise ConfigError(f"--target-{flag}-parallel-size {size}: give 1 or more")
    if vpp is not None and vpp < 1:
        raise ConfigError(f"--target-num-virtual-stages-per-pipeline-rank {vpp}: give 1 or more")
    iteration = required_latest_iteration(load_dir)
    shards = read_shards(iteration_dir(load_dir, iteration))
    cfg = model_config(shards[0, 0])
    refuse_mtp(cfg.mtp_num_layers, f"Megatron-LM's checkpoints (--ckpt-format {ckpt_format})")
    if cfg.multi_latent_attention:
        refuse_mla_yarn(cfg.rope_type, f"Megatron-LM's checkpoints (--ckpt-format {ckpt_format})")
    layout = shards[0, 0]["config"]
    vpp_source, ends = 1, (None, None)
    if tp is None and pp is None:  # the source's layout: its chunks, its uneven stages
        was = layout["pipeline_model_parallel_size"]
        vpp_source = len(layer_ids(shards[0, 0], 0, was, cfg))
        ids = [layer_ids(shards[0, p], p, was, cfg) for p in range(was)]
        ends = ends_of([sum(map(len, chunks)) for chunks in ids])
    tp = layout["tensor_model_parallel_size"] if tp is None else tp
    pp = layout["pipeline_model_parallel_size"] if pp is None else pp
    vpp = vpp or vpp_source
    if uneven(first, last):  # the target's split, checked as megart train checks it
        ends = (first, last)
        try:
            check_stages(cfg.num_layers, pp, vpp, first, last)
        except ConfigError as e:
            raise ConfigError(
                f"{e} (here: --target-decoder-first/last-pipeline-num-layers, for "
                f"--target-pipeline-parallel-size {pp})"
            ) from e
    try:
        cfg.check_layout(tp, pp, vpp, *ends)
    except ConfigError as e:
        raise ConfigError(
            f"{e} (here: the checkpoint written, --target-tensor-parallel-size {tp}, "
            f"--target-pipeline-parallel-size {pp}, "
            f"--target-num-virtual-stages-per-pipeline-rank {vpp})"
        ) from e
    whole = whole_tensors(shards, cfg)
    weights = to_megatron({k: v.clone() for k, v in whole.items()}, cfg)
    bias = megatron_expert_bias.of_shards(shards)
    if bias is not None:  # Megatron-Core's routers' buffers, in every layout's files
        megatron_expert_bias.added(weights, bias, cfg)
    for name in VOCAB_NAMES:
        if name in weights:  # the padding of tp ranks, as Megatron's args say
            weights[name] = fit_vocab(weights[name], cfg.padded_vocab_size(tp))
    args = megatron_args(cfg, iteration, tp, pp, vpp, *ends)
    vars(args).update(shards[0, 0].get("tokenizer") or {})  # as megart train's args record it
    if ckpt_format == "torch_dist":  # one store for every layout; args say tp's vocab padding
        args.ckpt_format = ckpt_format
        root = megatron_dist.write(save_dir, iteration, args, weights, cfg)
        replace_text(Path(save_dir) / TRACKER, f"{iteration}\n")
        return [root]
    paths = []
    for (t, p), chunks in megatron_layout.split(weights, cfg, tp, pp, vpp, *ends).items():
        out = iteration_dir(save_dir, iteration) / rank_dir(t, p, pp) / FILE
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rank_state(args, iteration, chunks), out)
        paths.append(out)
    replace_text(Path(save_dir) / TRACKER, f"{iteration}\n")
    return paths


def read_rank(path: Path) -> dict[str, Any]:
    """One rank's file of a Megatron-LM legacy checkpoint, memory-mapped."""
    try:
        state = torch_load(path, mmap=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise ConfigError(f"{path} cannot be read as a Megatron-LM checkpoint ({e})") from e
    if not isinstance(state, dict) or state.get("args") is None:
        raise ConfigError(f"{path} is not a Megatron-LM legacy checkpoint (no args)")
    if "model" not in state and "model0" not in state:
        raise ConfigError(f"{path} is not a Megatron-LM legacy checkpoint (no model)")
    return state


def first_rank_file(root: Path) -> Path | None:
    found = sorted(root.glob(f"mp_rank_*/{FILE}"))
    return found[0] if found else None


def saved_args(
    load_dir: str | os.PathLike, iteration: int | None = None
) -> tuple[dict[str, Any], Path, int]:
    """Megatron-LM's args (``vars``), the iteration directory and the iteration of the
    Megatron-LM checkpoint of ``iteration`` (default: the latest) in ``load_dir``, legacy or
    torch_dist."""
    if iteration is None:
        iteration = required_latest_iteration(load_dir, " (Megatron-LM's checkpoint)")
    root = iteration_dir(load_dir, iteration)
    if megatron_dist.is_dist_checkpoint(root):
        return vars(megatron_dist.read_common(root)["args"]), root, iteration
    first = first_rank_file(root)
    if first is None:
        raise ConfigError(
            f"{root} holds neither mp_rank_*/{FILE} (legacy) nor "
            f"{megatron_dist.METADATA} (torch_dist): not a Megatron-LM checkpoint"
        )
    a = vars(read_rank(first)["args"])
    check_args(a, first)
    return a, root, iteration


def read_megatron(load_dir: str | os.PathLike) -> tuple[GPTConfig, dict[str, Any], int]:
    """The model config, whole Megatron-Core state dict (vocabulary padded for one rank) and
    iteration of the latest Megatron-LM checkpoint in ``load_dir``: legacy, of any tensor- and
    pipeline-parallel layout, or torch_dist."""
    return _merged(*saved_args(load_dir))


def _merged(a: dict[str, Any], root: Path, iteration: int) -> tuple[GPTConfig, dict[str, Any], int]:
    """read_megatron's result, from saved_args' (args, iteration directory, iteration)."""
    cfg = config_from_args(a)
    if megatron_dist.is_dist_checkpoint(root):
        model = megatron_dist.read(root)
    else:
        tp = a.get("tensor_model_parallel_size") or 1
        pp = a.get("pipeline_model_parallel_size") or 1
        ep = a.get("expert_model_parallel_size") or 1
        paths = expert_rank_files(root, tp, pp, ep)
        # Each (tensor, pipeline) rank's expert-parallel files as one (global expert numbers).
        ranks = {
            (t, p): merged_megatron_chunks(
                [model_chunks(read_rank(paths[t, p, e])) for e in range(ep)], cfg.num_experts
            )
            for t in range(tp)
            for p in range(pp)
        }
        model = megatron_layout.merge(ranks, cfg, tp, pp, **saved_stages(a))
    for name in VOCAB_NAMES:
        if name in model:
            model[name] = fit_vocab(model[name], cfg.padded_vocab_size(1))
    return cfg, model, iteration


def megatron_weights(
    load_dir: str | os.PathLike, iteration: int | None = None
) -> tuple[GPTConfig, dict[str, torch.Tensor], dict[str, str] | None]:
    """The model, whole weights under megart's one-chunk names (vocabulary padded for one
    rank) and tokenizer record (what its args record) of the Megatron-LM checkpoint of
    ``iteration`` (default: the latest) in ``load_dir``: legacy, of any layout, or torch_dist.
    The routers' expert biases, buffers and not weights, are left out (_weights_and_bias)."""
    return _weights_and_bias(load_dir, iteration)[:3]


def _weights_and_bias(
    load_dir: str | os.PathLike, iteration: int | None = None
) -> tuple[GPTConfig, dict[str, torch.Tensor], dict[str, str] | None, torch.Tensor | None]:
    """megatron_weights' result and the routers' expert biases as megart's rows (None
    without)."""
    a, root, iteration = saved_args(load_dir, iteration)
    cfg, model, _ = _merged(a, root, iteration)
    bias = megatron_expert_bias.popped(model, cfg)
    return cfg, from_megatron(model, cfg), tokenizer_record.record(a), bias


def megatron_to_megart(load_dir: str | os.PathLike, save_dir: str | os.PathLike) -> Path:
    """The latest Megatron-LM checkpoint in ``load_dir`` as a megart release checkpoint
    (weights only, and the routers' expert biases; --load reshards it to any layout and
    starts at iteration 0)."""
    cfg, weights, tokenizer, bias = _weights_and_bias(load_dir)
    layers = list(range(cfg.num_layers))
    return write_release(save_dir, cfg, weights, layers, tokenizer, expert_bias=bias)
