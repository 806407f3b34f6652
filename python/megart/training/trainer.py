"""The Trainer: one training loop for every parallel layout (tensor, pipeline, data).

Each iteration takes the same global batch for every layout (a pure function of the seed and
the iteration), gives each data-parallel rank its share as m microbatches, runs the pipeline
schedule, averages gradients over data parallelism (in buckets, during backward), sums the
tied embedding's two gradients, clips by the global norm across model parallelism, and steps
AdamW. The same seed gives the same loss curve under every layout.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

import megart
import megart.distributed as dist
from megart import schedule as sched
from megart.errors import ConfigError
from megart.models import pipeline_chunks
from megart.optim.loss_scale import LossScaler
from megart.pipeline import PipelineEngine, StageLink
from megart.tensor_parallel import (
    RNGStatesTracker,
    seed_tensor_parallel,
    sync_sequence_parallel_grads,
)
from megart.training import batch_rampup, checkpoint, checkpoint_dirs
from megart.training import optimizer as optim
from megart.training.config import TrainConfig
from megart.training.data import Dataset, build_datasets
from megart.training.flops import model_flops
from megart.training.housekeeping import Housekeeping
from megart.training.megatron_flags import mock_tokens
from megart.training.reporting import RunLog, peak_flops, run_description
from megart.training.stopping import EarlyExit, check_finite


class Trainer:
    """Builds the grid, the model chunks of this rank, the pipeline engine, the gradient
    buckets and the optimizer from a :class:`TrainConfig`; :meth:`train` runs the loop."""

    def __init__(self, config: TrainConfig, tokens: Any | None = None) -> None:
        self.config = c = config
        # The flags and --save are checked before any rank waits on another, so that every rank
        # refuses them alike (and rank 0 alone need say so).
        world = dist.get_world_size() if dist.is_initialized() else _launched_world_size()
        self.dp = c.check(world)
        if c.save:
            checkpoint_dirs.check_writable(c.save)
        if not dist.is_initialized():
            dist.init(
                backend=c.distributed_backend,
                timeout=timedelta(minutes=c.distributed_timeout_minutes),
            )
        self.grid = megart.initialize(tp=c.tp, pp=c.pp, dp=self.dp, backend=c.distributed_backend)
        g = self.grid
        self.m = c.microbatches(self.dp)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if (torch.cuda.is_available())
            else torch.device("cpu")
        )
        self.chores = Housekeeping(c, self.device, dist.get_rank())
        self.model_config = c.gpt_config()
        self.rng = RNGStatesTracker()
        # The replicated stream differs per pipeline stage (different layers), the
        # tensor-parallel stream per tensor-parallel rank.
        seed_tensor_parallel(self.rng, c.seed + 1000 * g.pp_rank, g.tp_rank)
        self.chunks = [
            chunk.to(self.device)
            for chunk in pipeline_chunks(
                self.model_config,
                g.pp_rank,
                c.pp,
                c.chunks,
                g.tp_group,
                c.sequence_parallel,
                self.rng,
                v_shape=c.schedule == "zb-v",
            )
        ]
        seq = c.seq_length // c.tp if c.sequence_parallel else c.seq_length
        # Scatter/gather applies to tensors replicated across tensor parallelism: with
        # sequence parallelism each rank already holds a distinct slice.
        link = StageLink(
            g.pp_group, g.tp_group, c.scatter_gather_tensors_in_pipeline and not c.sequence_parallel
        )
        self.link = link
        self._activation = (seq, c.micro_batch_size, c.hidden_size)
        # One engine per number of microbatches (--rampup-batch-size varies it), built on
        # first use; evaluation and a constant batch use the full batch's.
        self._engines: dict[int, PipelineEngine] = {}
        self.engine = self.engine_for(self.m)
        self.buckets, self.optimizer = optim.build(c, self.chunks, g, self.device)
        # The validation range is evaluated every --eval-interval iterations, the test range
        # once at the end (none without --eval-iters).
        if tokens is None and c.mock_data:
            tokens = mock_tokens(c)
        self.data, self.valid, self.test = build_datasets(
            c.data_path,
            c.split,
            c.seq_length,
            c.vocab_size,
            tokens,
            evaluate=c.eval_iters > 0,
            mmap=c.mmap_bin_files,
        )
        self.peak, self.device_name = peak_flops()
        # TFLOP/s count what runs (Megatron's causal count, plus the recomputed forward under
        # full recomputation); MFU counts the model's FLOPs only, as its definition says.
        self.model_flops = model_flops(self.model_config, c.global_batch_size, tp=c.tp)
        self.flops = model_flops(
            self.model_config,
            c.global_batch_size,
            recompute=self.model_config.recompute_granularity == "full",
            tp=c.tp,
        )
        self.scaler = (
            LossScaler(
                init_scale=c.loss_scale or c.initial_loss_scale,
                growth_interval=c.loss_scale_window,
                min_scale=c.min_loss_scale,
                hysteresis=c.hysteresis,
            )
            if c.fp16
            else None
        )
        self.start_iteration = 0  # iterations already done (a resumed run starts later)
        self.consumed = 0  # samples trained so far (Megatron's consumed_train_samples)
        if c.load and checkpoint_dirs.no_checkpoint_yet(c.load):
            # A restartable job line (--save X --load X) on its first run, as Megatron does.
            if dist.get_rank() == 0:
                print(
                    f"megart train: --load {c.load} holds no checkpoint yet: starting from scratch",
                    flush=True,
                )
        elif c.load:
            # megart's files or Megatron-LM's legacy ones (read as megart's: megatron_files).
            self.start_iteration, self.consumed = checkpoint.load(
                c.load, c, g, self.chunks, self.optimizer, self.rng, self.scaler
            )

    def save_checkpoint(self, iterations_done: int) -> None:
        """Writes a checkpoint after ``iterations_done`` iterations to --save (every rank)."""
        self.wait_for_params()
        checkpoint.save(
            self.config.save,
            iterations_done,
            self.config,
            self.grid,
            self.chunks,
            self.optimizer,
            self.rng,
            self.scaler,
            self.consumed,
        )

    def engine_for(self, m: int) -> PipelineEngine:
        """The pipeline engine of an iteration of ``m`` microbatches (schedules are cached)."""
        if m not in self._engines:
            c, g = self.config, self.grid
            schedule = sched.build(c.schedule, c.pp, m, c.chunks)
            self._engines[m] = PipelineEngine(
                schedule, g.pp_rank, self.chunks, self.link, self._activation, device=self.device
            )
        return self._engines[m]

    # -- one iteration ----------------------------------------------------------------------

    def _microbatches(
        self, data: Dataset, iteration: int, size: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's microbatches of the global batch of ``size`` samples of ``iteration``."""
        c, g = self.config, self.grid
        inputs, targets = data.global_batch(c.seed, iteration, size)
        share = size // self.dp
        rows = slice(g.dp_rank * share, (g.dp_rank + 1) * share)
        split = c.micro_batch_size
        return (
            [x.to(self.device) for x in inputs[rows].split(split)],
            [y.to(self.device) for y in targets[rows].split(split)],
        )

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.chunks[-1].loss(logits, targets)

    def _autocast(self) -> contextlib.AbstractContextManager:
        c = self.config
        if not (c.bf16 or c.fp16):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16 if c.bf16 else torch.float16)

    def _overflowed(self) -> bool:
        """fp16: unscales the gradients and says whether any rank saw an inf or NaN (then every
        rank skips the step); updates a dynamic loss scale."""
        params = optim.stepped_params(self.chunks, self.optimizer)
        found = self.scaler.unscale_(params).to(self.device)
        dist.all_reduce(found, op="max")
        overflow = bool(found.item())
        if self.config.loss_scale is None:
            self.scaler.update(overflow)
        return overflow

    def train_step(self, iteration: int) -> dict[str, float]:
        """Runs one iteration, the next after the samples consumed so far (whose number sets
        its global batch under --rampup-batch-size); returns its figures (the same on every
        rank)."""
        c, g = self.config, self.grid
        t0 = time.perf_counter()
        batch = batch_rampup.batch_size(c, self.consumed)
        m = c.microbatches(self.dp, batch)
        inputs, targets = self._microbatches(self.data, iteration, batch)
        self.buckets.zero_grad()
        self.buckets.start_iteration(m)
        dist.reset_bytes_sent(g.pp_group)
        scale = self.scaler.scale if self.scaler else 1.0
        with self._autocast():
            # Each microbatch's loss is divided by m: the gradient is the batch mean's.
            losses = self.engine_for(m).run(inputs, targets, self._loss_fn, scale)
        self.buckets.finish()
        self.chores.after_forward_backward()
        for chunk in self.chunks:
            sync_sequence_parallel_grads(chunk, g.tp_group)
        optim.share_embedding_grads(self.chunks, g, c.pp, self.buckets)
        skipped = self.scaler is not None and self._overflowed()
        grad_norm = (
            math.nan
            if skipped
            else optim.clip(self.chunks, g, self.optimizer, c.clip_grad, self.device)
        )
        if c.check_for_nan_in_loss_and_grad and not skipped:
            check_finite("gradient norm", grad_norm, iteration + 1)  # before the step
        # Under --rampup-batch-size the schedule runs on samples, counted in global batches.
        done = self.consumed / c.global_batch_size
        lr = c.learning_rate(done)
        for group in self.optimizer.param_groups:  # --decoupled-lr's group: its own peak, floor
            group["lr"] = c.learning_rate(done, group.get("max_lr"), group.get("min_lr"))
        if not skipped:
            self.optimizer.step()
        self.chores.after_optimizer_step()
        # The global-batch mean loss: the last stage has it, averaged over data parallelism.
        figures = torch.tensor(
            [
                sum(x.item() for x in losses) / m if losses else 0.0,
                float(sum(dist.bytes_sent(g.pp_group).values())),
            ],
            dtype=torch.float64,
            device=self.device,  # nccl groups move device memory only
        )
        dist.all_reduce(figures[:1], group=g.pp_group)  # only the last stage adds a loss
        dist.all_reduce(figures[:1], op="avg", group=g.dp_group)
        dist.all_reduce(figures[1:])  # bytes: summed over every rank
        if c.check_for_nan_in_loss_and_grad and not skipped:
            check_finite("loss", figures[0].item(), iteration + 1)
        self.consumed += batch
        elapsed = time.perf_counter() - t0
        tokens = batch * c.seq_length
        share = batch / c.global_batch_size  # FLOPs are linear in the batch
        tflops = self.flops * share / elapsed / dist.get_world_size() / 1e12
        return {
            "iteration": iteration + 1,
            "global_batch_size": batch,
            "microbatches": m,
            "consumed_samples": self.consumed,
            "loss": figures[0].item(),
            "grad_norm": grad_norm,
            "lr": lr,
            "time_s": elapsed,
            "tokens_per_s": tokens / elapsed,
            "tflops_per_gpu": tflops,
            "mfu": (
                self.model_flops * share / elapsed / dist.get_world_size() / self.peak
                if self.peak
                else None
            ),
            "pipeline_p2p_bytes": int(figures[1].item()),
            "loss_scale": scale,
            "skipped": skipped,
        }

    def evaluate(self, data: Dataset | None = None) -> float:
        """The validation loss: the mean over --eval-iters global batches of the validation
        split (or of ``data``, e.g. ``self.test``), forward only through the pipeline, with
        dropout off; the same on every rank. The batches are the same at every evaluation, so
        the curve compares like with like, and no random stream moves, so evaluating never
        changes the training curve."""
        c, g = self.config, self.grid
        data = self.valid if data is None else data
        if data is None:
            raise ConfigError("evaluation needs --eval-iters of at least 1")
        for chunk in self.chunks:
            chunk.eval()
        try:
            total = 0.0
            for i in range(c.eval_iters):
                inputs, targets = self._microbatches(data, i, c.global_batch_size)
                with self._autocast():
                    losses = self.engine.evaluate(inputs, targets, self._loss_fn)
                total += sum(x.item() for x in losses) / self.m
                self.chores.after_forward_backward()
        finally:
            for chunk in self.chunks:
                chunk.train()
        loss = torch.tensor([total / c.eval_iters], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss, group=g.pp_group)  # only the last stage adds a loss
        dist.all_reduce(loss, op="avg", group=g.dp_group)
        return loss.item()

    # -- the loop ----------------------------------------------------------------------------

    def _loss_and_ppl(self, split: str, data: Dataset) -> dict[str, float]:
        with self.chores.evaluating():
            loss = self.evaluate(data)
        return {f"{split}_loss": loss, f"{split}_ppl": math.exp(min(20.0, loss))}  # as Megatron

    def iterations(self) -> Iterator[dict[str, float]]:
        """Runs the iterations left (from a loaded checkpoint's on), saving every
        --save-interval iterations and after the last one when --save is given, and adding
        ``valid_loss`` and ``valid_ppl`` every --eval-interval iterations and after the last, and
        ``test_loss`` and ``test_ppl`` (the test range) after the last. Stops early (saving
        first) as --exit-interval, --exit-duration-in-mins or --exit-signal-handler say, with
        ``exit`` (why) in the last figures."""
        c = self.config
        with EarlyExit(c, self.device).installed() as early, self.chores.running():
            for it in range(self.start_iteration, c.train_iters):
                self.chores.before_iteration(it)
                figures = self.train_step(it)
                done = it + 1
                self.chores.after_iteration(done)
                last = done == c.train_iters
                if self.valid is not None and (done % c.eval_interval == 0 or last):
                    figures.update(self._loss_and_ppl("valid", self.valid))
                if self.test is not None and last:
                    figures.update(self._loss_and_ppl("test", self.test))
                stop = None if last else early.reason(done)
                # As Megatron, a checkpoint also before each change of the ramp's batch.
                grows = batch_rampup.batch_size(c, self.consumed) != figures["global_batch_size"]
                interval = c.save_interval and done % c.save_interval == 0
                if c.save and (last or stop or interval or grows):
                    self.save_checkpoint(done)
                if stop:
                    figures["exit"] = stop
                if last or stop:
                    self.wait_for_params()
                yield figures
                if stop:
                    return

    def wait_for_params(self) -> None:
        """Finishes the parameter all-gathers --overlap-param-gather leaves running after a
        step (the next forward would wait for them): for readers outside a forward."""
        if hasattr(self.optimizer, "wait_for_params"):
            self.optimizer.wait_for_params()

    def train(self, quiet: bool = False) -> list[dict[str, float]]:
        """Runs every iteration, printing a progress line every --log-interval iterations on
        rank 0 and writing --log-jsonl and --tensorboard-dir there; returns every iteration's
        figures."""
        history = []
        rank0 = dist.get_rank() == 0
        with RunLog(self.config, rank0, quiet, self.device.type == "cpu") as log:
            if log.printing:
                log.say(self.describe())
            start = time.perf_counter()
            for fig in self.iterations():
                history.append(fig)
                log.record(fig)
            log.finish(history, time.perf_counter() - start)
        return history

    def describe(self) -> str:
        """The line that starts a run: the model, the layout, the batch and the device."""
        return run_description(self)


def _launched_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 without it); init() checks it further."""
    value = os.environ.get("WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1
