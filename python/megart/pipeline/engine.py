"""The pipeline engine: runs one training iteration of a C++ schedule on this rank's model
chunks, action by action.

Each rank follows its posting plan (:func:`megart.schedule.post_plan`, C++): the schedule's compute
actions in order, and its messages in groups that agree with the neighbours' groups, as NCCL
requires, each posted as soon as its sends' tensors exist (receives early, so transfers overlap
compute); a receive is waited for only when the compute that needs it is next; sends stay in
flight while compute runs; a chunk's activations are freed as soon as its backward is done;
the loss lives on the last stage. ``evaluate`` runs the schedule's forward-only pass the same
way (validation loss).

Zero-bubble schedules (zb-h1, zb-v) split each backward: I runs autograd from the stage's output
to its input with the linear layers' weight gradients kept aside (see
:mod:`megart.tensor_parallel.weight_grad`), W computes those later and frees what I kept. Where
two neighbouring virtual stages share this rank (zb-v's turn), the activation and its gradient
pass between the chunks directly, with no message.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import megart.distributed as dist
from megart import schedule as sched
from megart.errors import ConfigError, ScheduleError
from megart.pipeline.p2p import StageLink
from megart.tensor_parallel.weight_grad import WeightGradStore, deferring

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]


class PipelineEngine:
    """One pipeline rank: ``chunks[c]`` is the model chunk at virtual stage c * p + rank.

    ``activation_shape`` and ``dtype`` describe every tensor that crosses stages (one
    microbatch's hidden states), so receive buffers can be posted before the data exists.
    ``plan_costs``: the expected relative costs of the computes and messages, which the posting
    plan is made for (see :func:`megart.schedule.post_plan`; the trainer's are
    :func:`megart.training.pipeline_costs.plan_costs`); the same on every rank.

    A chunk with a ``set_loss_scale(factor)`` method is told, before each training run, the
    factor its losses' gradients carry (loss scale / m): megart's GPT chunks pass it to their
    MoE layers, whose auxiliary losses seed their own gradients (megart.models.moe); one with
    a ``set_microbatch(mb)`` method is told the microbatch before each forward and backward of
    it (the key of the MoE routers' noise, megart.models.router_noise).
    """

    def __init__(
        self,
        schedule: sched.Schedule,
        rank: int,
        chunks: Sequence[nn.Module],
        link: StageLink,
        activation_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        plan_costs: sched.Costs | None = None,
    ) -> None:
        if len(chunks) != schedule.chunks:
            raise ConfigError(
                f"the schedule has {schedule.chunks} model chunks per rank, got {len(chunks)}"
            )
        if schedule.stages > 1 and (
            link.pp_group is None or link.pp_group.size() != schedule.stages
        ):
            raise ConfigError(
                f"a {schedule.stages}-stage schedule needs a pipeline group of that size"
            )
        sched.validate(schedule)
        self.schedule, self.rank, self.chunks, self.link = schedule, rank, list(chunks), link
        self._evaluation = sched.forward_only(schedule)
        # This rank's steps for a training and an evaluation pass (every rank plans all ranks
        # alike, with the same costs, so the groups agree without a message).
        self._steps = {
            id(s): sched.post_plan(s, plan_costs)[rank] for s in (self.schedule, self._evaluation)
        }
        self._like = torch.empty(tuple(activation_shape), dtype=dtype, device=device)
        # Host seconds the last run() or evaluate() spent inside forward and backward actions;
        # the rest of its time went to posting and waiting for communication (on CPU, the
        # idle fraction).
        self.last_compute_time = 0.0
        # Linear layers whose weight gradient the last run's I's left to its W's (0 unsplit).
        self.last_deferred_weight_grads = 0
        # Which (rank, chunk) holds each virtual stage: tells a hand-over on this rank apart
        # from a message.
        self._where = {
            schedule.virtual_stage(r, c): (r, c)
            for r in range(schedule.stages)
            for c in range(schedule.chunks)
        }

    def _local_neighbour(self, chunk: int, step: int) -> int | None:
        """The chunk on this rank at virtual stage (this chunk's + step), if there is one."""
        where = self._where.get(self.schedule.virtual_stage(self.rank, chunk) + step)
        return where[1] if where is not None and where[0] == self.rank else None

    def _peer(self, pipeline_rank: int) -> int:
        return self.link.pp_group.ranks[pipeline_rank]

    def _name_microbatch(self, a: sched.Action) -> None:
        """Tells action ``a``'s chunk which microbatch it runs, where the chunk asks."""
        chunk = self.chunks[a.chunk]
        if hasattr(chunk, "set_microbatch"):
            chunk.set_microbatch(a.mb)

    def _first(self, chunk: int) -> bool:
        return self.schedule.virtual_stage(self.rank, chunk) == 0

    def _last(self, chunk: int) -> bool:
        s = self.schedule
        return s.virtual_stage(self.rank, chunk) == s.stages * s.chunks - 1

    def evaluate(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[Any] | None,
        loss_fn: LossFn,
        documents: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        """Runs the forward of every microbatch only (the schedule's forward_only pass, no
        autograd graph, each activation freed once sent); returns the losses as :meth:`run`
        does. Dropout stays as the modules' training flags set it: call ``eval()`` first."""
        with torch.no_grad():
            return self._execute(self._evaluation, inputs, targets, loss_fn, 1.0, documents)

    def run(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[Any] | None,
        loss_fn: LossFn,
        loss_scale: float = 1.0,
        documents: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        """Runs forward and backward of every microbatch; gradients accumulate in the chunks'
        parameters (the loss is divided by m, so they are the batch mean's, times
        ``loss_scale``, which fp16 training sets). ``inputs`` are
        needed on the first stage and ``targets`` (whatever ``loss_fn`` takes) on the last;
        ``documents``, where given, is each microbatch's second argument to every chunk (its
        positions and attention mask: megart.models.documents). Returns each microbatch's loss
        (detached) on the rank that holds the last stage, else an empty list."""
        return self._execute(self.schedule, inputs, targets, loss_fn, loss_scale, documents)

    def _execute(
        self,
        s: sched.Schedule,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[Any] | None,
        loss_fn: LossFn,
        loss_scale: float,
        documents: Sequence[Any] | None = None,
    ) -> list[torch.Tensor]:
        m = s.microbatches
        if any(self._first(c) for c in range(s.chunks)) and (inputs is None or len(inputs) != m):
            raise ConfigError(f"the first pipeline stage needs {m} microbatch inputs")
        if any(self._last(c) for c in range(s.chunks)) and (targets is None or len(targets) != m):
            raise ConfigError(f"the last pipeline stage needs {m} microbatch targets")

        training = not s.forward_only
        if training:  # MoE layers' auxiliary losses take the loss's factor (models.moe)
            for chunk in self.chunks:
                if hasattr(chunk, "set_loss_scale"):
                    chunk.set_loss_scale(loss_scale / m)
        recvs: dict[tuple[str, int, int], tuple[dist.Work, torch.Tensor]] = {}
        arrived: dict[tuple[str, int, int], torch.Tensor] = {}
        sends: list[dist.Work] = []
        stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses: dict[int, torch.Tensor] = {}

        store = WeightGradStore()

        def forward(a: sched.Action) -> None:
            if self._first(a.chunk):
                x = inputs[a.mb]
                leaf = None
            else:
                x = leaf = arrived.pop(("F", a.mb, a.chunk))
                if training:
                    x.requires_grad_()
            extra = () if documents is None else (documents[a.mb],)
            self._name_microbatch(a)
            out = self.chunks[a.chunk](x, *extra)
            if self._last(a.chunk):
                loss = loss_fn(out, targets[a.mb])
                losses[a.mb] = loss.detach()
                out = loss * (loss_scale / m)
            nxt = self._local_neighbour(a.chunk, +1)
            if nxt is not None:  # the next stage is on this rank: hand over, no message
                arrived[("F", a.mb, nxt)] = out.detach()
                if not training:
                    return
            if training or not self._last(a.chunk):  # evaluation keeps it until it is sent
                stash[(a.mb, a.chunk)] = (leaf, out)

        def backward(a: sched.Action) -> None:
            """B, or I (the weight gradients of linear layers left to W)."""
            leaf, out = stash.pop((a.mb, a.chunk))
            grad = None if self._last(a.chunk) else arrived.pop(("B", a.mb, a.chunk))
            self._name_microbatch(a)  # recomputation in this backward runs its forward
            if a.op == "I":
                with store.input_grad((a.mb, a.chunk)):
                    torch.autograd.backward(out, grad)
            else:
                torch.autograd.backward(out, grad)
            if leaf is not None:
                prev = self._local_neighbour(a.chunk, -1)
                key = ("dX", a.mb, a.chunk) if prev is None else ("B", a.mb, prev)
                arrived[key] = leaf.grad

        def weight(a: sched.Action) -> None:
            store.weight_grad((a.mb, a.chunk))

        run_compute = {"F": forward, "B": backward, "I": backward, "W": weight}

        def post(batch: list[sched.Action]) -> None:
            ops, keys = [], []
            for a in batch:
                if a.op in ("SEND_F", "SEND_B"):
                    if a.op == "SEND_B":
                        tensor = arrived.pop(("dX", a.mb, a.chunk))
                    elif training:
                        tensor = stash[(a.mb, a.chunk)][1]  # the backward needs it later
                    else:
                        tensor = stash.pop((a.mb, a.chunk))[1]
                    ops.append(self.link.send_op(tensor, self._peer(a.peer)))
                else:
                    buffer = self.link.wire_buffer(self._like)
                    ops.append(self.link.recv_op(buffer, self._peer(a.peer)))
                keys.append(a)
            for a, work, op in zip(keys, self.link.post(ops), ops, strict=True):
                if a.op.startswith("SEND"):
                    sends.append(work)
                else:
                    recvs[(a.op[-1], a.mb, a.chunk)] = (work, op.tensor)

        def finish_recv(key: tuple[str, int, int]) -> None:
            work, buffer = recvs.pop(key)
            work.wait()
            arrived[key] = self.link.from_wire(buffer, self._like)

        def run_step(a: sched.Action) -> None:
            # A receive posted for this compute's input (the plan posts it before) is the only
            # thing a compute waits on; a hand-over from this rank's other chunk is no message.
            key = ("F" if a.op == "F" else "B", a.mb, a.chunk)
            if a.op != "W" and key in recvs:
                finish_recv(key)
            run_compute[a.op](a)

        split = any(a.op == "W" for a in s.ranks[self.rank])
        with deferring(store) if split else contextlib.nullcontext():
            self.last_compute_time = self._drive(self._steps[id(s)], post, run_step, sends)
        if len(store):  # every W ran, so nothing an I kept may outlive the iteration
            raise ScheduleError(f"rank {self.rank}: {len(store)} weight gradients were never run")
        self.last_deferred_weight_grads = store.deferred
        return [losses[mb] for mb in range(m)] if losses else []

    def _drive(
        self,
        steps: list[sched.Step],
        post: Callable[[list[sched.Action]], None],
        run_step: Callable[[sched.Action], None],
        sends: list[dist.Work],
    ) -> float:
        """Takes this rank's steps in order, then waits for its sends; returns the host
        seconds spent computing."""
        compute_time = 0.0
        for step in steps:
            if step.compute is None:
                post(list(step.post))
                continue
            start = time.perf_counter()
            run_step(step.compute)
            compute_time += time.perf_counter() - start
        for work in sends:
            work.wait()
        sends.clear()
        return compute_time
