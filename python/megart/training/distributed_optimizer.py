"""The distributed optimizer (Megatron's --use-distributed-optimizer; ZeRO stage 1).

Each data-parallel rank keeps Adam's moments for 1/dp of the parameters only. The gradient
buckets (megart.training.grad_sync) reduce-scatter instead of all-reduce, so each rank holds the
averaged gradient of its own slice of every bucket; it steps that slice, and an all-gather of
each bucket's parameters gives every rank the whole updated model again. The bytes on the wire
are those of the all-reduce it replaces (a reduce-scatter plus an all-gather); the optimizer
state per rank falls by dp.

A slice is a range of a bucket's flat buffer, so it may cut a parameter anywhere: the optimizer
steps 1-D views ("pieces") of the parameters. To make those views possible the parameters are
moved into flat buffers laid out as the gradient buckets are.

With 16-bit parameters (--half-weights) the parameters' buffers are 16-bit, and each rank keeps
fp32 main weights for its own slices only (Megatron-LM's 2 + 12/dp bytes per parameter with the
moments): a step updates them, rounds them into the 16-bit buffer, and the all-gather moves 16-bit
parameters, half the bytes. :meth:`DistributedOptimizer.full_precision` gathers the whole fp32
weights into the parameters for as long as a checkpoint is written or read.

Checkpoints do not change: :meth:`DistributedOptimizer.state_dict` gathers the moments into the
state dict a plain optimizer over the whole parameters would have (a collective over the
data-parallel group), and :meth:`load_state_dict` takes this rank's slices of one. So a run may
switch the flag on or off on resume, and resharding and export work as before.

Under expert parallelism the buckets come in two sets (training.expert_grads.SplitBuckets):
the experts' shard over their expert-data-parallel group (dp x cp / ep ranks), as
Megatron-Core's second distributed optimizer over its expert_parallel_buffers, the dense ones
over data (and context) parallelism. Each bucket's slices, all-gathers and gathered moments go
over the group of the set that owns it (``buckets.owner``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import megart.distributed as dist
from megart.training.grad_sync import GradientBuckets, _Bucket

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Piece:
    """This rank's slice of one parameter: elements [start, end) of ``param`` flattened, a view
    ``data`` of them (with ``data.grad`` the same slice of the gradient) stepped by the inner
    optimizer. With 16-bit parameters ``data`` is a view of this rank's fp32 main weights."""

    param: torch.nn.Parameter
    index: int  # the parameter's number in a plain optimizer's state dict
    start: int
    end: int
    data: torch.Tensor
    bucket: int  # which gradient bucket holds it
    at: int  # where the slice starts in that bucket's flat buffer


def pieces_of(
    offsets: Sequence[int], numels: Sequence[int], shard: tuple[int, int]
) -> list[tuple[int, int, int]]:
    """(parameter number, start, end) of each parameter that overlaps ``shard`` (a range of the
    bucket), for parameters laid out at ``offsets`` with ``numels`` elements; start and end
    count within the parameter."""
    lo, hi = shard
    out = []
    for i, (offset, n) in enumerate(zip(offsets, numels, strict=True)):
        start, end = max(lo, offset), min(hi, offset + n)
        if start < end:
            out.append((i, start - offset, end - offset))
    return out


class DistributedOptimizer:
    """Steps this rank's slices of ``param_groups`` (torch.optim-style groups of the whole
    parameters) with the optimizer ``make_optimizer`` builds from groups of pieces.

    ``buckets`` must shard (``GradientBuckets(..., shard=True)``); each bucket's slices are
    gathered over the group of the set that reduces it (``buckets.owner``: data parallelism,
    or the experts' expert-data-parallel group). ``param_groups`` is kept as given, so setting
    ``group["lr"]`` between steps works as with any torch optimizer.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        buckets: GradientBuckets,
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    ) -> None:
        self.param_groups = param_groups
        self.buckets = buckets
        # The bucket set (its group, its number of slices) each bucket is sharded over.
        self._owners = [buckets.owner(b) for b in buckets.buckets]
        self.steps = 0  # steps taken (the same on every rank); a state dict's "step"
        # A parameter's number in a plain optimizer's state dict, and its group.
        self._index = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
        group_of = {id(p): k for k, g in enumerate(param_groups) for p in g["params"]}
        self.pieces: list[Piece] = []
        self.param_buffers = [self._move_into_buffer(b) for b in buckets.buckets]
        # fp32 main weights of this rank's slice of each bucket, where the parameters are 16-bit
        self.main_buffers: list[torch.Tensor | None] = []
        for k, (b, buffer) in enumerate(zip(buckets.buckets, self.param_buffers, strict=True)):
            lo, hi = buckets.shard_range(b)
            main = buffer[lo:hi].float() if buffer.dtype != torch.float32 else None
            self.main_buffers.append(main)
            # What the step updates: the parameters' own buffer, or the main weights of the slice.
            stepped, base = (buffer, 0) if main is None else (main, lo)
            numels = [p.numel() for p in b.params]
            for i, start, end in pieces_of(b.offsets, numels, (lo, hi)):
                p, at = b.params[i], b.offsets[i] + start
                data = stepped[at - base : at - base + end - start]
                data.grad = b.buffer[at : at + end - start]
                self.pieces.append(Piece(p, self._index[id(p)], start, end, data, k, at))
        inner_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in param_groups
        ]
        for piece in self.pieces:
            inner_groups[group_of[id(piece.param)]]["params"].append(piece.data)
        self.optimizer = make_optimizer(inner_groups)
        self.overlap_param_gather = False  # see overlap_with_forward
        self._gathers: dict[int, dist.Work] = {}
        self._hooks: list[Any] = []

    @staticmethod
    def _move_into_buffer(b: _Bucket) -> torch.Tensor:
        """A flat buffer for the parameters of ``b`` (in their dtype), laid out as its
        gradients; each parameter's data becomes a view into it."""
        buffer = torch.zeros(b.buffer.numel(), dtype=b.params[0].dtype, device=b.buffer.device)
        for p, offset in zip(b.params, b.offsets, strict=True):
            view = buffer[offset : offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
        return buffer

    # -- stepping ---------------------------------------------------------------------------

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's slices of the gradients (what the step reads)."""
        return [piece.data.grad for piece in self.pieces]

    def step(self) -> None:
        """Steps this rank's slices with the hyperparameters now in ``param_groups``, then
        all-gathers every bucket's parameters over the data-parallel group."""
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.optimizer.step()
        self.steps += 1
        for b, buffer, main in zip(
            self.buckets.buckets, self.param_buffers, self.main_buffers, strict=True
        ):
            if main is not None:  # this rank's slice, rounded into the 16-bit parameters
                start, end = self.buckets.shard_range(b)
                buffer[start:end].copy_(main)
        for k, (b, buffer, owner) in enumerate(
            zip(self.buckets.buckets, self.param_buffers, self._owners, strict=True)
        ):
            if owner.parts > 1:
                start, end = self.buckets.shard_range(b)
                # In place: this rank's slice of the output is the input, as NCCL allows.
                self._gathers[k] = dist.all_gather_into_tensor(
                    buffer, buffer[start:end], group=owner.group, async_op=True
                )
        if not self.overlap_param_gather:
            self.wait_for_params()

    def wait_for_params(self, buckets: Sequence[int] | None = None) -> None:
        """Waits for the all-gathers of ``buckets`` (all by default) that the last step left
        running: after it their parameters are whole again."""
        for k in list(self._gathers) if buckets is None else buckets:
            work = self._gathers.pop(k, None)
            if work is not None:
                work.wait()

    def overlap_with_forward(self, modules: Sequence[torch.nn.Module]) -> None:
        """Megatron's --overlap-param-gather: :meth:`step` leaves the all-gathers running, and
        each module of ``modules`` (and their submodules) waits, before its forward, only for
        the buckets holding its own parameters; so the gathers of layers late in the forward
        overlap the compute of earlier ones. Whoever reads parameters outside a forward
        (checkpoints) calls :meth:`wait_for_params` first. A module in ``modules`` itself waits
        for every bucket of its parameters (weights it reads without calling the submodule
        that owns them, as the tied output layer reads the embedding's)."""
        self.overlap_param_gather = True
        bucket_number = {id(b): k for k, b in enumerate(self.buckets.buckets)}

        def hook_for(params: list[torch.nn.Parameter]) -> Callable[..., None]:
            wanted = sorted(
                {bucket_number[id(self.buckets.bucket_of(p))] for p in params if p.requires_grad}
            )
            return lambda module, args: self.wait_for_params(wanted)

        for top in modules:
            for module in top.modules():
                own = list(module.parameters(recurse=module is top))
                if own:
                    self._hooks.append(module.register_forward_pre_hook(hook_for(own)))

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.buckets.zero_grad()

    @contextlib.contextmanager
    def full_precision(self) -> Iterator[None]:
        """With 16-bit parameters: for the duration each parameter holds its fp32 main weight
        (every rank's slices, all-gathered: a collective), so that checkpoints write and read
        fp32 weights; what is loaded into them becomes this rank's main weights and, rounded,
        the parameters. Without: nothing changes."""
        if all(main is None for main in self.main_buffers):
            yield
            return
        # Every bucket has main weights: the parameters are all of one 16-bit type.
        self.wait_for_params()
        wholes = []
        for b, main, owner in zip(
            self.buckets.buckets, self.main_buffers, self._owners, strict=True
        ):
            whole = main
            if owner.parts > 1:
                whole = torch.empty(b.buffer.numel(), dtype=torch.float32, device=main.device)
                dist.all_gather_into_tensor(whole, main, group=owner.group)
            wholes.append(whole)
            for p, offset in zip(b.params, b.offsets, strict=True):
                p.data = whole[offset : offset + p.numel()].view_as(p)
        try:
            yield
        finally:
            for b, buffer, main, whole in zip(
                self.buckets.buckets, self.param_buffers, self.main_buffers, wholes, strict=True
            ):
                start, end = self.buckets.shard_range(b)
                if whole is not main:
                    main.copy_(whole[start:end])
                buffer.copy_(whole)
                for p, offset in zip(b.params, b.offsets, strict=True):
                    p.data = buffer[offset : offset + p.numel()].view_as(p)

    # -- state dicts in the format of a plain optimizer over the whole parameters ------------

    def state_dict(self) -> dict[str, Any]:
        """What a plain optimizer over the whole parameters would return: every parameter's
        moments, gathered over the data-parallel group (the experts' over their
        expert-data-parallel group). A collective: call it on every rank of the group."""
        self.wait_for_params()
        groups, start = [], 0
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            n = len(outer["params"])
            hyper = {k: v for k, v in inner.items() if k != "params"}
            groups.append({**hyper, "params": list(range(start, start + n))})
            start += n
        state: dict[int, dict[str, Any]] = {}
        if self.steps:
            for k, b in enumerate(self.buckets.buckets):
                for key in MOMENTS:
                    whole = self._gather(k, key)
                    for p, offset in zip(b.params, b.offsets, strict=True):
                        entry = state.setdefault(self._index[id(p)], {})
                        entry[key] = whole[offset : offset + p.numel()].view_as(p).clone()
            for entry in state.values():
                entry["step"] = torch.tensor(float(self.steps))
        return {"state": state, "param_groups": groups}

    def _gather(self, k: int, key: str) -> torch.Tensor:
        """Bucket ``k``'s whole ``key`` moment: each rank's slice, all-gathered."""
        b = self.buckets.buckets[k]
        start, end = self.buckets.shard_range(b)
        mine = torch.zeros(end - start, dtype=torch.float32, device=b.buffer.device)
        for piece in self.pieces:
            if piece.bucket == k and piece.data in self.optimizer.state:
                at = piece.at - start
                mine[at : at + piece.end - piece.start] = self.optimizer.state[piece.data][key]
        owner = self._owners[k]
        if owner.parts == 1:
            return mine  # the whole bucket
        whole = torch.empty(b.buffer.numel(), dtype=torch.float32, device=b.buffer.device)
        dist.all_gather_into_tensor(whole, mine, group=owner.group)
        return whole

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a plain optimizer's state dict (torch's or megart's AdamW over the whole
        parameters, or this class's): this rank keeps its slices of the moments."""
        saved = state_dict["state"]
        inner = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        numbered = [d for g in self.optimizer.param_groups for d in g["params"]]
        position = {id(d): j for j, d in enumerate(numbered)}
        # Every entry has the same step: the parameters are stepped together.
        steps = int(float(next(iter(saved.values()))["step"])) if saved else 0
        for piece in self.pieces:
            entry = saved.get(piece.index)
            if entry:
                state[position[id(piece.data)]] = {
                    **{k: entry[k].reshape(-1)[piece.start : piece.end].clone() for k in MOMENTS},
                    "step": torch.tensor(float(steps)),
                }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": now["params"]}
            for g, now in zip(state_dict["param_groups"], inner["param_groups"], strict=True)
        ]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        for outer, loaded in zip(self.param_groups, groups, strict=True):
            outer.update({k: v for k, v in loaded.items() if k != "params" and k in outer})
        self.steps = steps
