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
import time
from collections.abc import Iterator
from typing import Any

import torch

import megart.distributed as dist
from megart import schedule as sched
from megart.errors import ConfigError
from megart.models.moe_router import finish_iteration
from megart.models.router_noise import start_batch
from megart.pipeline import PipelineEngine
from megart.tensor_parallel import fusing_accumulation, sync_sequence_parallel_grads
from megart.training import batch_rampup, iteration_stats, memory_report
from megart.training import optimizer as optim
from megart.training import trainer_setup as setup
from megart.training.checkpoint_scheduler import with_saved_schedule
from megart.training.checkpointer import Checkpointer
from megart.training.config import TrainConfig
from megart.training.data import Dataset
from megart.training.documents import (
    DocumentBatches,
    MaskedTargets,
    given,
    masked_loss,
    rank_microbatches,
)
from megart.training.dtypes import half_dtype, residual_dtype
from megart.training.housekeeping import Housekeeping
from megart.training.loss_record import LossRecord, global_loss_and_p2p_bytes, reduce_sums
from megart.training.lr import weight_decay_rate
from megart.training.megatron_blend import eval_batch
from megart.training.moe_metrics import moe_losses
from megart.training.mtp_metrics import feed_labels, mtp_losses
from megart.training.pad_tokens import megatron_pad_id
from megart.training.pipeline_costs import plan_costs
from megart.training.reporting import RunLog, peak_flops, run_description
from megart.training.stopping import EarlyExit, check_finite
from megart.training.timers import Timers


class Trainer:
    """Builds the grid, the model chunks of this rank, the pipeline engine, the gradient
    buckets and the optimizer from a :class:`TrainConfig`; :meth:`train` runs the loop."""

    def __init__(self, config: TrainConfig, tokens: Any | None = None) -> None:
        # The steps run in this order (trainer_setup says why each is where it is): every rank
        # refuses bad flags before any waits on another, and the random streams are seeded
        # before the weights are drawn, so that a seed gives one loss curve.
        # --use-checkpoint-opt_param-scheduler: the resumed checkpoint's schedule as the flags.
        self.config = c = with_saved_schedule(config)
        self.dp = setup.checked_dp_size(c)
        self.grid = g = setup.join_grid(c, self.dp)
        self.m = c.microbatches(self.dp)
        self.device = setup.local_device()
        self.chores = Housekeeping(c, self.device, dist.get_rank())
        self.timers = Timers(c.timing_log_level, self.device)  # Megatron's, by phase
        # The model: this rank's chunks of the GPT, on seeded streams.
        self.model_config = c.gpt_config()
        self.rng = setup.seeded_streams(c, g)
        self.chunks = setup.model_chunks(c, self.model_config, g, self.rng, self.device)
        # The pipeline: one engine per number and size of microbatches (--rampup-batch-size
        # varies the number; evaluation's flags may set both), built on first use.
        self.link = setup.stage_link(c, g)
        self._activation = setup.activation_shape(c)
        self._engines: dict[tuple[int, int], PipelineEngine] = {}
        # Data-parallel gradient buckets (reduced during backward) and AdamW.
        self.buckets, self.optimizer = optim.build(c, self.chunks, g, self.device)
        self.data, self.valid, self.test = setup.datasets(c, tokens, self.dp)
        # --eod-mask-loss, --reset-position-ids, --reset-attention-mask (training.documents).
        # And under --data-order megatron, Megatron-Core's pad labels (training.pad_tokens).
        self.pad = megatron_pad_id(c)
        dp_cp = self.dp * c.context_parallel_size
        needed = given(c) or self.pad is not None
        self.documents = DocumentBatches(c, dp_cp, self.pad) if needed else None
        self.losses = LossRecord()  # the last stage's microbatch losses: what is reported
        # What the progress line reports against: the device's peak and a batch's FLOPs.
        self.peak, self.device_name = peak_flops()
        self.model_flops, self.flops = setup.flop_counts(c, self.model_config)
        self.scaler = setup.loss_scaler(c)
        # Where the loop starts: iteration 0, or where --load's checkpoint left off.
        self.start_iteration, self.consumed = setup.resume_point(
            c, g, self.chunks, self.optimizer, self.rng, self.scaler
        )
        self.saves = Checkpointer(c)  # --save's, non-persistent ones, --async-save's in flight

    def save_checkpoint(self, iterations_done: int, kind: str = "persistent") -> None:
        """Writes a checkpoint after ``iterations_done`` iterations (every rank): to --save, or
        a non-persistent one (``kind``); with --async-save it is finalized at the next save or
        by ``self.saves.finish()``."""
        self.wait_for_params()
        with optim.full_precision(self.optimizer):  # --half-weights: the fp32 main weights
            self.saves.save(kind, iterations_done, self)

    def engine_for(self, m: int, micro: int | None = None) -> PipelineEngine:
        """The pipeline engine of an iteration of ``m`` microbatches of ``micro`` samples (None:
        --micro-batch-size; evaluation's may differ: the stages send that shape); cached."""
        c, g = self.config, self.grid
        micro = micro or c.micro_batch_size
        if (m, micro) not in self._engines:
            seq, _, hidden = self._activation
            schedule = sched.build(c.schedule, c.pp, m, c.chunks)
            self._engines[m, micro] = PipelineEngine(
                schedule,
                g.pp_rank,
                self.chunks,
                self.link,
                (seq, micro, hidden),
                residual_dtype(c),
                device=self.device,
                plan_costs=plan_costs(c),
            )
        return self._engines[m, micro]

    # -- one iteration ----------------------------------------------------------------------

    def _microbatches(
        self, data: Dataset, iteration: int, size: int, micro: int | None = None
    ) -> tuple[list[torch.Tensor], list[Any], list[Any] | None]:
        """This rank's microbatches (of ``micro`` samples; None: --micro-batch-size) of the
        global batch of ``size`` samples of ``iteration`` (its data-parallel share of the
        samples, and of each its context-parallel part): their inputs, targets (with a loss
        mask, training.documents' targets) and documents (None without the reset flags)."""
        c, g = self.config, self.grid
        batch = data.global_batch(c.seed, iteration, size)
        ranks = (self.dp, g.dp_rank, g.cp_rank)
        return rank_microbatches(c, self.documents, batch, *ranks, self.device, micro)

    def _loss_fn(self, logits: torch.Tensor, targets: Any) -> torch.Tensor:
        if isinstance(targets, MaskedTargets):  # --eod-mask-loss, Megatron's pad labels
            loss, total, count = masked_loss(
                self.chunks[-1].token_losses(logits, targets.labels, targets.mask), targets
            )
            self.losses.add(total, count)
            return loss
        loss = self.chunks[-1].loss(logits, targets)
        self.losses.add(loss, 1.0)
        return loss

    def _autocast(self) -> contextlib.AbstractContextManager:
        half = half_dtype(self.config)
        if half is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=half)

    def train_step(self, iteration: int) -> dict[str, float]:
        """Runs one iteration, the next after the samples consumed so far (whose number sets
        its global batch under --rampup-batch-size); returns its figures (the same on every
        rank)."""
        c = self.config
        t0 = time.perf_counter()
        batch = batch_rampup.batch_size(c, self.consumed)
        m = c.microbatches(self.dp, batch)
        scale = self.scaler.scale if self.scaler else 1.0  # the scale this iteration runs at
        self._forward_backward(iteration, batch, m, scale)
        with self.timers.phase("optimizer"):
            skipped, grad_norm, lr, stats = self._update_weights(iteration)
        loss, p2p_bytes = global_loss_and_p2p_bytes(self.losses, self.grid, self.device)
        mtp = mtp_losses(self.chunks, self.model_config, self.grid, m, self.device)
        moe = moe_losses(
            self.chunks, self.model_config, self.grid, m, self.device, c.moe_per_layer_logging
        )
        if c.check_for_nan_in_loss_and_grad and not skipped:
            check_finite("loss", loss, iteration + 1)
        self.consumed += batch
        elapsed = time.perf_counter() - t0
        tokens = batch * c.seq_length
        share = batch / c.global_batch_size  # FLOPs are linear in the batch
        tflops = self.flops * share / elapsed / dist.get_world_size() / 1e12
        if c.timing_log_level and (iteration + 1) % c.log_interval == 0:
            stats["timers_ms"] = self.timers.report(c.log_interval)  # every rank's
        return {
            "iteration": iteration + 1,
            "global_batch_size": batch,
            "microbatches": m,
            "consumed_samples": self.consumed,
            "loss": loss,
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
            "pipeline_p2p_bytes": p2p_bytes,
            **moe,  # load_balancing_loss, z_loss (training.moe_metrics)
            **mtp,  # "mtp_k loss" (training.mtp_metrics)
            "loss_scale": scale,
            "skipped": skipped,
            **stats,
            **memory_report.static_figure(self.device),  # on CUDA only
        }

    def _forward_backward(self, iteration: int, batch: int, m: int, scale: float) -> None:
        """Runs the pipeline schedule over this rank's ``m`` microbatches of the iteration's
        ``batch`` samples and completes their gradients (averaged over data parallelism, summed
        over sequence parallelism and over the tied embedding's two copies), ready to step;
        the last stage's microbatch losses go to ``self.losses``."""
        c, g, timed = self.config, self.grid, self.timers.phase
        with timed("batch-generator"):
            inputs, targets, documents = self._microbatches(self.data, iteration, batch)
        start_batch(self.chunks, ("train", iteration), self.grid.dp_rank * (batch // self.dp))
        self.losses.clear()
        self.buckets.zero_grad()
        self.buckets.start_iteration(m)
        dist.reset_bytes_sent(g.pp_group)
        fusion = fusing_accumulation(c.gradient_accumulation_fusion)
        with self._autocast(), fusion, timed("forward-backward"):
            # Each microbatch's loss is divided by m: the gradient is the batch mean's.
            feed_labels(self.chunks, targets, self.pad)  # multi-token prediction's tokens
            self.engine_for(m).run(inputs, targets, self._loss_fn, scale, documents)
        with timed("all-grads-sync"):
            self.buckets.finish()
        self.chores.after_forward_backward()
        with timed("layernorm-grads-all-reduce"):
            for chunk in self.chunks:
                sync_sequence_parallel_grads(chunk, g.tp_group)
        with timed("embedding-grads-all-reduce"):
            optim.share_embedding_grads(self.chunks, g, c.pp, self.buckets)
        finish_iteration(self.chunks, g)  # the routers' part of Megatron's finalize_model_grads

    def _update_weights(self, iteration: int) -> tuple[bool, float, float, dict[str, Any]]:
        """Clips the gradients by their global norm and steps AdamW at this iteration's learning
        rate, unless an fp16 overflow skips the step on every rank; returns (skipped, gradient
        norm, learning rate, the figures --log-num-zeros-in-grad and --log-params-norm ask
        for)."""
        c, g, timed = self.config, self.grid, self.timers.phase
        skipped = False
        if self.scaler is not None:  # fp16
            with timed("optimizer-unscale-and-check-inf"):
                skipped = optim.overflowed(self.chunks, self.optimizer, self.scaler, c, self.device)
        with timed("optimizer-clip-main-grad"):
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
        if c.weight_decay_incr_style != "constant":  # Megatron's rising weight decay
            optim.set_weight_decay(self.optimizer, weight_decay_rate(c, done))
        stats: dict[str, Any] = {}
        stats_args = (self.chunks, g, self.optimizer, self.device)
        if c.log_num_zeros_in_grad:  # what the step reads, after clipping, as Megatron counts
            with timed("optimizer-count-zeros"):
                stats["num_zeros_in_grad"] = (
                    None if skipped else iteration_stats.zeros_in_grads(*stats_args)
                )
        if not skipped:
            with timed("optimizer-inner-step"):
                self.optimizer.step()
        self.chores.after_optimizer_step()
        if c.log_params_norm:
            stats["params_norm"] = iteration_stats.params_norm(*stats_args)
        if c.log_world_size_to_tensorboard:
            stats["world_size"] = dist.get_world_size()
        return skipped, grad_norm, lr, stats

    def evaluate(self, data: Dataset | None = None, first: int = 0) -> float:
        """The validation loss: the mean over --eval-iters global batches of the validation
        split (or of ``data``, e.g. ``self.test``), forward only through the pipeline, with
        dropout off; the same on every rank. The batches are the same at every evaluation, so
        the curve compares like with like, and no random stream moves, so evaluating never
        changes the training curve. ``first``: the first batch (--data-order megatron's
        validation goes on from evaluation to evaluation, as Megatron's iterator)."""
        c = self.config
        data = self.valid if data is None else data
        if data is None:
            raise ConfigError("evaluation needs --eval-iters of at least 1")
        for chunk in self.chunks:
            chunk.eval()
        self.losses.clear()
        size, micro = c.eval_batch_sizes  # --eval-global-batch-size, --eval-micro-batch-size
        engine = self.engine_for(size // (micro * self.dp), micro)
        try:
            for i in range(c.eval_iters):
                inputs, targets, documents = self._microbatches(data, first + i, size, micro)
                start_batch(self.chunks, ("eval", first + i), self.grid.dp_rank * (size // self.dp))
                with self._autocast():
                    engine.evaluate(inputs, targets, self._loss_fn, documents)
                self.chores.after_forward_backward()
        finally:
            for chunk in self.chunks:
                chunk.train()
        # Over every batch's microbatches (Megatron's evaluation sums them all alike).
        sums = torch.tensor(self.losses.take(), dtype=torch.float64, device=self.device)
        reduce_sums(sums, self.grid)
        return (sums[0] / sums[1]).item()

    # -- the loop ----------------------------------------------------------------------------

    def _loss_and_ppl(self, split: str, data: Dataset, first: int = 0) -> dict[str, float]:
        with self.chores.evaluating():
            loss = self.evaluate(data, first)
        return {f"{split}_loss": loss, f"{split}_ppl": math.exp(min(20.0, loss))}  # as Megatron

    def iterations(self) -> Iterator[dict[str, float]]:
        """Runs the iterations left (from a loaded checkpoint's on), saving every
        --save-interval iterations and after the last one when --save is given (and a
        non-persistent checkpoint every --non-persistent-save-interval), and adding
        ``valid_loss`` and ``valid_ppl`` every --eval-interval iterations and after the last, and
        ``test_loss`` and ``test_ppl`` (the test range) after the last. Stops early (saving
        first) as --exit-interval, --exit-duration-in-mins or --exit-signal-handler say, with
        ``exit`` (why) in the last figures."""
        with self.saves.completing():  # a background save in flight, finalized at the end
            yield from self._iterations()

    def _iterations(self) -> Iterator[dict[str, float]]:
        c = self.config
        with EarlyExit(c, self.device).installed() as early, self.chores.running():
            for it in range(self.start_iteration, c.train_iters):
                self.chores.before_iteration(it)
                figures = self.train_step(it)
                done = it + 1
                self.chores.after_iteration(done)
                last = done == c.train_iters
                if self.valid is not None and (done % c.eval_interval == 0 or last):
                    first = eval_batch(c, done, last) if c.data_order == "megatron" else 0
                    figures.update(self._loss_and_ppl("valid", self.valid, first))
                if self.test is not None and last:
                    figures.update(self._loss_and_ppl("test", self.test))
                stop = None if last else early.reason(done)
                # As Megatron, a checkpoint also before each change of the ramp's batch.
                grows = batch_rampup.batch_size(c, self.consumed) != figures["global_batch_size"]
                interval = c.save_interval and done % c.save_interval == 0
                kind = self.saves.due(done, bool(last or stop or interval or grows))
                if kind:
                    self.save_checkpoint(done, kind)
                if stop:
                    figures["exit"] = stop
                if last or stop:
                    self.saves.finish()  # the checkpoint complete before the last figures
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
        rank = dist.get_rank()
        memory = memory_report.MemoryLines(
            self.grid.dp_rank == 0 and not quiet, rank, self.start_iteration
        )
        with RunLog(self.config, rank == 0, quiet, self.device.type == "cpu", memory) as log:
            if log.printing:
                log.say(self.describe())
            start = time.perf_counter()
            for fig in self.iterations():
                # The allocator's counters as the iteration is reported, so after its evaluation
                # and checkpoint if any (Megatron reads them before those); the static figure,
                # taken at the end of the step, holds neither.
                fig.update(memory_report.sample(self.device))
                history.append(fig)
                log.record(fig)
            log.finish(history, time.perf_counter() - start)
        return history

    def describe(self) -> str:
        """The line that starts a run: the model, the layout, the batch and the device."""
        return run_description(self)
