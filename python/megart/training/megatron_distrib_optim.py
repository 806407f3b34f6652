"""Megatron-LM's legacy checkpoint with the distributed optimizer (``--ckpt-format torch
--use-distributed-optimizer``), both ways: ``distrib_optim.pt`` beside each rank's
``model_optim_rng.pt``, and that file's ``optimizer`` entry.

Megatron-Core 0.16.1 (megatron/core/distributed/param_and_grad_buffer.py,
optimizer/distrib_optimizer.py, and Megatron-LM's training/checkpointing.py) lays a model
chunk's parameters into one flat buffer per (parameter dtype, gradient dtype): in reverse
``named_parameters()`` order, each starting at a multiple of 64 elements; a bucket closes once
it holds ``bucket_size`` elements or more (no limit without --overlap-grad-reduce, on pipeline
ranks after the first and on model chunks after the first; else --ddp-bucket-size, or with
--ddp-num-buckets N the rank's parameters over all its model chunks // N, by default
max(4e7, 1e6 x data-parallel size): grad_sync.megatron_bucket_size), and a tied word embedding
or output layer under pipeline parallelism gets a bucket of its own. Each bucket is then padded
at its end to a multiple of lcm(data-parallel size, 128). Data-parallel rank 0 saves
(``save_parameter_state``, from ``get_parameter_state_dp_zero``) ``{"buckets_coalesced":
True, chunk: {(param dtype, grad dtype): {"param", "exp_avg", "exp_avg_sq": fp32 vectors,
"numel_unpadded": n}}}``: the
buckets one after another without their end padding, a parameter's fp32 main copy and Adam
moments flattened at its place, zeros in the gaps between parameters. The rank file's
``optimizer`` is then DistributedOptimizer.state_dict(): ``{"optimizer": {"param_groups": [the
groups without "params", each with "step"]}}`` and, with --fp16, ``"grad_scaler"``.

Here a rank file in the non-distributed layout (megart.training.megatron_files) is turned into
that pair and back, so everything else of the format is shared with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megart.errors import ConfigError
from megart.training import checksum
from megart.training.grad_sync import megatron_bucket_size
from megart.training.megatron_expert_files import file_place
from megart.training.megatron_files import model_chunks, torch_load
from megart.training.megatron_layout import OUTPUT, WORD
from megart.training.megatron_optimizer import is_decoupled, is_parameter, param_groups_of

DISTRIB_FILE = "distrib_optim.pt"
KEYS = ("param", "exp_avg", "exp_avg_sq")
PARAM_ALIGN = 64  # elements: each parameter starts 128-byte aligned (16-bit or wider)
BUCKET_ALIGN = 128  # elements: each bucket ends 256-byte aligned, and divides over dp


@dataclass(frozen=True)
class BufferLayout:
    """Where each parameter of a model chunk lies in the saved vector of its buffer."""

    ranges: dict[str, tuple[int, int]]  # name -> [start, end)
    buckets: tuple[int, ...]  # each bucket's part of it (its buckets' numel_unpadded)

    @property
    def numel(self) -> int:
        """The vector's length (Megatron's numel_unpadded): its buckets one after another."""
        return sum(self.buckets)

    def locate(self, at: int) -> tuple[int, int]:
        """(bucket, offset in that bucket) of element ``at`` of the vector."""
        starts = [sum(self.buckets[:k]) for k in range(len(self.buckets))]
        k = max(i for i, start in enumerate(starts) if start <= at)
        return k, at - starts[k]


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


def buffer_layout(
    params: list[tuple[str, int, bool]], bucket_size: int | None, dp: int
) -> BufferLayout:
    """The saved vector's layout for a chunk's ``params`` (name, elements, whether it is a
    tied embedding copy under pipeline parallelism), in ``named_parameters()`` order."""
    ranges: dict[str, tuple[int, int]] = {}
    saved = 0  # elements of the buckets closed so far, without their end padding
    bucket_start = start = members = 0
    buckets: list[int] = []

    def close(end: int) -> int:
        """Closes the bucket at ``end``; returns where the next one starts."""
        nonlocal saved, bucket_start, members
        saved += end - bucket_start
        buckets.append(end - bucket_start)
        bucket_start, members = _up(end, math.lcm(dp, BUCKET_ALIGN)), 0
        return bucket_start

    for name, numel, alone in reversed(params):
        start = _up(start, PARAM_ALIGN)
        if alone and members:  # the bucket before closes where this one would have started
            start = close(start)
        end = start + numel
        ranges[name] = (saved + start - bucket_start, saved + end - bucket_start)
        members += 1
        full = bucket_size is not None and end - bucket_start >= bucket_size
        start = close(end) if alone or full else end
    if members:
        close(start)
    return BufferLayout(ranges, tuple(buckets))


def bucket_size(args: dict[str, Any], pp_rank: int, chunk: int, num_parameters: int) -> int | None:
    """The bucket size Megatron-LM's DistributedDataParallel uses for model chunk ``chunk`` of
    pipeline rank ``pp_rank``, given the run's flags (``vars(args)``) and the elements of all
    the rank's model chunks' parameters (what --ddp-num-buckets divides)."""
    size = megatron_bucket_size(
        num_parameters,
        _dp(args),
        args.get("ddp_bucket_size"),
        args.get("ddp_num_buckets"),
        bool(args.get("overlap_grad_reduce")),
    )
    return None if pp_rank > 0 or chunk > 0 else size


def _dp(args: dict[str, Any]) -> int:
    return int(args.get("data_parallel_size") or 1)


def dp_cp_size(args: dict[str, Any]) -> int:
    """The ranks a buffer is sharded over: Megatron-Core's DistributedDataParallel pads its
    buckets for the data x context-parallel group (its default bucket size counts data
    parallelism alone: _dp)."""
    return _dp(args) * int(args.get("context_parallel_size") or 1)


def _params(chunk: dict[str, Any], args: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """(name, elements, tied copy under pipeline parallelism) of a chunk's parameters."""
    tied = not args.get("untie_embeddings_and_output_weights") and (
        (args.get("pipeline_model_parallel_size") or 1) > 1
    )
    names = [n for n, v in chunk.items() if is_parameter(n, v)]
    # The tied copy: the word embedding on the first stage, the output layer on the last.
    alone = tied and (WORD in names) != (OUTPUT in names)
    return [(n, chunk[n].numel(), alone and n in (WORD, OUTPUT)) for n in names]


def layouts(
    chunks: list[dict[str, Any]],
    args: dict[str, Any],
    pp_rank: int,
    total: int | None = None,
    shard: int | None = None,
) -> list:
    """Each model chunk's BufferLayout (``chunks``: Megatron-Core names, in its order). Under
    expert parallelism ``chunks`` is one buffer set's part of the rank's model: ``total`` then
    counts all the rank's parameters (what --ddp-num-buckets divides) and ``shard`` is the
    group the set shards over (the experts': expert-data-parallel)."""
    params = [_params(chunk, args) for chunk in chunks]
    if total is None:
        total = sum(numel for chunk in params for _, numel, _ in chunk)
    shard = dp_cp_size(args) if shard is None else shard
    return [
        buffer_layout(chunk, bucket_size(args, pp_rank, c, total), shard)
        for c, chunk in enumerate(params)
    ]


def dtype_key(args: dict[str, Any]) -> tuple[torch.dtype, torch.dtype]:
    """(parameter dtype, gradient dtype) of the buffer: Megatron-LM reduces bf16 runs' (unless
    --grad-reduce-in-bf16) and --accumulate-allreduce-grads-in-fp32 runs' gradients in fp32."""
    if args.get("bf16"):
        grad = torch.bfloat16 if args.get("grad_reduce_in_bf16") else torch.float32
        return torch.bfloat16, grad
    if args.get("fp16"):
        grad = torch.float32 if args.get("accumulate_allreduce_grads_in_fp32") else torch.float16
        return torch.float16, grad
    return torch.float32, torch.float32


def is_distributed(optimizer: Any) -> bool:
    """Whether a rank file's ``optimizer`` is DistributedOptimizer.state_dict()'s (its
    parameter state elsewhere, in distrib_optim.pt)."""
    return (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("optimizer"), dict)
        and "state" not in optimizer["optimizer"]
        and "fp32_from_fp16_params" not in optimizer
    )


def split(
    state: dict[str, Any], pp_rank: int, total: int | None = None, shard: int | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rank file in the non-distributed layout (to_megatron_file's, of pipeline rank
    ``pp_rank``) as the distributed optimizer writes it: the file with
    DistributedOptimizer.state_dict() as its optimizer, and distrib_optim.pt's contents
    (``total``, ``shard``: as layouts takes them)."""
    args = vars(state["args"])
    chunks = model_chunks(state)
    optimizer = state["optimizer"]
    half = "fp32_from_fp16_params" in optimizer
    inner = optimizer["optimizer"] if half else optimizer
    groups = param_groups_of(chunks, is_decoupled(args))
    numbered = [p for group in groups for p in group]
    moments = {numbered[i]: s for i, s in inner["state"].items()}
    # The fp32 main copies: the masters under --fp16/--bf16, else the weights themselves.
    masters = [m for g in optimizer["fp32_from_fp16_params"] for m in g] if half else None
    main = (
        dict(zip(numbered, masters, strict=True))
        if half
        else {p: chunks[p[0]][p[1]] for p in numbered}
    )
    steps = {float(s["step"]) for s in moments.values()}
    if len(steps) > 1:
        raise ConfigError(f"the optimizer's parameters were stepped {sorted(steps)} times")
    param_state: dict[Any, Any] = {"buckets_coalesced": True}
    for c, layout in enumerate(layouts(chunks, args, pp_rank, total, shard)):
        vectors: dict[str, Any] = {k: torch.zeros(layout.numel) for k in KEYS}
        for name, (start, end) in layout.ranges.items():
            vectors["param"][start:end] = main[c, name].detach().reshape(-1).float()
            for key in KEYS[1:]:
                if (c, name) in moments:
                    vectors[key][start:end] = moments[c, name][key].reshape(-1)
        vectors["numel_unpadded"] = layout.numel
        param_state[c] = {dtype_key(args): vectors}
    step = steps.pop() if steps else 0.0
    dist_optimizer: dict[str, Any] = {
        "optimizer": {
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "step": step}
                for g in inner["param_groups"]
            ]
        }
    }
    if "grad_scaler" in optimizer:
        dist_optimizer["grad_scaler"] = optimizer["grad_scaler"]
    return {**state, "optimizer": dist_optimizer}, param_state


def _pp_rank(path: Path, args: dict[str, Any]) -> int:
    """The pipeline rank of the file at ``path`` (its folder's name; under expert parallelism
    the expert-parallel rank follows it)."""
    pp = args.get("pipeline_model_parallel_size") or 1
    return file_place(path, pp, args.get("expert_model_parallel_size") or 1)[1]


def read_param_state(path: Path, chain: int = 1) -> Any:
    """distrib_optim.pt beside the rank file ``path``: one optimizer's state, or with ``chain``
    2 (expert parallelism's ChainedOptimizer) the list of the dense one's (None where
    another rank wrote it) and the experts'."""
    where = path.parent / DISTRIB_FILE
    if not where.exists():
        raise ConfigError(
            f"{path} was saved with --use-distributed-optimizer, but {where} (its optimizer "
            "state) is missing; resume with --no-load-optim (fresh optimizer state)"
        )
    checksum.verify(where)
    try:
        loaded = torch_load(where, mmap=True)
    except (RuntimeError, EOFError, OSError) as e:
        raise ConfigError(f"{where} cannot be read as Megatron's distrib_optim.pt ({e})") from e
    held = len(loaded) if isinstance(loaded, list) else 1
    if held != chain or (chain > 1 and not isinstance(loaded, list)):
        raise ConfigError(
            f"{where} holds {held} optimizers' states where its rank file has {chain} (a chain "
            "other than expert parallelism's dense and experts' pair, such as "
            "--overlap-param-gather-with-optimizer-step's, which megart does not have)"
        )
    for part in loaded if isinstance(loaded, list) else [loaded]:
        _check_coalesced(part, where)
    return loaded


def _check_coalesced(loaded: Any, where: Path) -> None:
    if loaded is None:  # a chain's dense state, written beside another expert-parallel rank's
        return
    if not isinstance(loaded, dict) or not loaded.get("buckets_coalesced"):
        raise ConfigError(
            f"{where} is in Megatron's layout from before 2024 (per bucket, not coalesced); "
            "convert it with Megatron-LM's --ckpt-convert-update-legacy-dist-opt-format first, "
            "or resume with --no-load-optim"
        )


def join(
    state: dict[str, Any],
    path: Path,
    loaded: dict[Any, Any] | None = None,
    total: int | None = None,
    shard: int | None = None,
) -> dict[str, Any]:
    """A rank file the distributed optimizer wrote (megart's or Megatron-LM's), with its
    distrib_optim.pt (or ``loaded``, one optimizer's part of it, whose parameters are the
    file's model then: ``total`` and ``shard`` as layouts takes them), in the non-distributed
    layout (the inverse of split); other files as they are."""
    optimizer = state.get("optimizer")
    if not is_distributed(optimizer):
        return state
    args = vars(state["args"])
    chunks = model_chunks(state)
    part = loaded is not None  # Megatron-Core makes no group without parameters
    loaded = read_param_state(path) if loaded is None else loaded
    groups = [g for g in param_groups_of(chunks, is_decoupled(args)) if g or not part]
    saved_groups = optimizer["optimizer"]["param_groups"]
    if len(saved_groups) != len(groups):
        raise ConfigError(
            f"{path}: its optimizer has {len(saved_groups)} param groups, not the "
            f"{len(groups)} of Megatron-Core's for its flags (weight decay on matrices, none on "
            "biases and norms, --decoupled-lr's between them): saved with other optimizer "
            "overrides, which megart does not have; resume with --no-load-optim"
        )
    buffers = sorted(k for k in loaded if isinstance(k, int))
    if buffers != list(range(len(chunks))) or any(len(loaded[c]) != 1 for c in buffers):
        raise ConfigError(
            f"{path.parent / DISTRIB_FILE} holds buffers {buffers} of dtypes "
            f"{[list(loaded[c]) for c in buffers]}, not one per model chunk of the file "
            f"({len(chunks)}): parameters of several dtypes, which megart does not have"
        )
    per_param: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for c, layout in enumerate(layouts(chunks, args, _pp_rank(path, args), total, shard)):
        (vectors,) = loaded[c].values()
        if vectors["numel_unpadded"] != layout.numel:
            raise ConfigError(
                f"{path.parent / DISTRIB_FILE}: model chunk {c}'s buffer holds "
                f"{vectors['numel_unpadded']} elements where this model's parameters, laid out "
                f"as Megatron-Core does for the saved flags, take {layout.numel} (saved with "
                "other --ddp-bucket-size, --ddp-num-buckets or padding flags?); resume with "
                "--no-load-optim"
            )
        for name, (start, end) in layout.ranges.items():
            shape = chunks[c][name].shape
            per_param[c, name] = {k: vectors[k][start:end].view(shape).clone() for k in KEYS}
    steps = {float(g["step"]) for g in saved_groups if g.get("step") is not None}
    if len(steps) > 1:
        raise ConfigError(f"{path}: its param groups were stepped {sorted(steps)} times")
    step = torch.tensor(steps.pop() if steps else 0.0)
    inner_state, param_groups, index = {}, [], 0
    for members, group in zip(groups, saved_groups, strict=True):
        numbers = list(range(index, index + len(members)))
        for i, p in zip(numbers, members, strict=True):
            inner_state[i] = {"step": step.clone(),
                              **{k: per_param[p][k] for k in KEYS[1:]}}  # fmt: skip
        index += len(members)
        hyper = {k: v for k, v in group.items() if k not in ("params", "step")}
        param_groups.append({**hyper, "params": numbers})
    inner = {"state": inner_state, "param_groups": param_groups}
    if not (args.get("fp16") or args.get("bf16")):
        return {**state, "optimizer": inner}
    out: dict[str, Any] = {
        "optimizer": inner,
        "fp32_from_fp16_params": [[per_param[p]["param"] for p in g] for g in groups],
    }
    if "grad_scaler" in optimizer:
        out["grad_scaler"] = optimizer["grad_scaler"]
    return {**state, "optimizer": out}
