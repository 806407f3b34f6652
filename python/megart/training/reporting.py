"""What the trainer reports: its progress and validation lines, the GPU's peak for MFU and
TensorBoard scalars, and where they go (RunLog)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import torch

from megart.errors import ConfigError
from megart.training import memory_report
from megart.training.flops import PEAK_FLOPS
from megart.training.timers import tensorboard_scalars, timer_lines


def peak_flops() -> tuple[float | None, str]:
    """The dense bf16 peak of this GPU, from its name, or None on CPU."""
    if not torch.cuda.is_available():
        return None, "CPU"
    name = torch.cuda.get_device_name()
    for key, peak in PEAK_FLOPS.items():
        if key in name:
            return peak, name
    return None, name


# TensorBoard tags, Megatron-LM's where it has one, for the figures of an iteration.
TENSORBOARD_TAGS = {
    "lm loss": "loss",
    "batch-size": "global_batch_size",
    "grad-norm": "grad_norm",
    "num-zeros": "num_zeros_in_grad",
    "params-norm": "params_norm",
    "world-size": "world_size",
    "learning-rate": "lr",
    "tokens-per-second": "tokens_per_s",
    "tflops-per-gpu": "tflops_per_gpu",
    "mfu": "mfu",
    "pipeline-p2p-bytes": "pipeline_p2p_bytes",
    "load_balancing_loss": "load_balancing_loss",  # MoE's (training.moe_metrics)
    "z_loss": "z_loss",
    "lm loss validation": "valid_loss",
    "lm loss validation ppl": "valid_ppl",
    "lm loss test": "test_loss",
    "lm loss test ppl": "test_ppl",
}


MOE_LOSSES = ("load_balancing_loss", "z_loss")


def progress_line(fig: dict[str, Any], train_iters: int, cpu: bool = False) -> str:
    """One iteration's figures; on CPU (``cpu``) throughput per process, with no GPU peak."""
    return (
        f"iteration {fig['iteration']:>5}/{train_iters} | consumed samples "
        f"{fig['consumed_samples']} | global batch size {fig['global_batch_size']} | loss "
        f"{fig['loss']:.4f} | grad norm {fig['grad_norm']:.3f} | "
        + (f"num zeros {zeros} | " if (zeros := fig.get("num_zeros_in_grad")) is not None else "")
        + (f"params norm {norm:.3f} | " if (norm := fig.get("params_norm")) is not None else "")
        + "".join(f"{name} {fig[name]:.4E} | " for name in MOE_LOSSES if name in fig)
        # Multi-token prediction's depth losses, under Megatron-LM's names (training.mtp_metrics)
        + "".join(f"{name} {value:.4E} | " for name, value in fig.items() if name[:4] == "mtp_")
        + f"lr {fig['lr']:.2e} | "
        f"{fig['tokens_per_s']:,.0f} tokens/s | "
        + _throughput(fig["tflops_per_gpu"], fig["mfu"], cpu)
    )


def _throughput(tflops: float, mfu: float | None, cpu: bool) -> str:
    if cpu:
        return f"{tflops * 1e3:.3f} GFLOP/s per process (CPU)"
    return f"{tflops:.3f} TFLOP/s per GPU | MFU " + (
        f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    )


# Iterations left out of a run's averages: the first ones pay for imports, page faults and
# thread start-up (a first run's first iterations ran 50x slower than its later ones).
WARMUP_ITERS = 2


def summary_line(
    history: list[dict[str, Any]], seconds: float, cpu: bool, save: str | None, log: str | None
) -> str:
    """The line that ends a run: iterations, wall time, mean throughput over the iterations
    after the warm-up ones, the last losses and where the checkpoint and log went."""
    if not history:
        return "megart train: no iterations to run (the checkpoint had reached --train-iters)"
    warm = WARMUP_ITERS if len(history) > WARMUP_ITERS else 0
    timed = history[warm:]
    tokens = sum(f["tokens_per_s"] for f in timed) / len(timed)
    tflops = sum(f["tflops_per_gpu"] for f in timed) / len(timed)
    mfus = [f["mfu"] for f in timed if f["mfu"] is not None]
    mfu = sum(mfus) / len(mfus) if mfus else None
    last = history[-1]
    valid = next((f["valid_loss"] for f in reversed(history) if "valid_loss" in f), None)
    n = len(history)
    parts = [
        f"megart train: done: {n} iteration{'s' * (n != 1)} (to {last['iteration']}) in "
        f"{seconds:.1f} s",
        f"mean over iterations {timed[0]['iteration']}-{last['iteration']}"
        + (f" ({warm} warm-up iteration{'s' * (warm != 1)} excluded)" if warm else "")
        + f": {tokens:,.0f} tokens/s, {_throughput(tflops, mfu, cpu)}",
        f"final train loss {last['loss']:.4f}"
        + (f", validation loss {valid:.4f}" if valid is not None else ""),
    ]
    if save:
        parts.append(f"checkpoint in {save}")
    if log:
        parts.append(f"log in {log}")
    return " | ".join(parts)


def validation_line(fig: dict[str, Any], split: str = "valid") -> str:
    """Megatron's validation report, one line: of the validation range, or of the test range
    (``split="test"``) at the end of training."""
    if split == "valid":
        where = f"at iteration {fig['iteration']}"
    else:
        where = "at the end of training for test data"
    return (
        f"validation loss {where} | lm loss value: {fig[split + '_loss']:.4f} | lm loss PPL: "
        f"{fig[split + '_ppl']:.3f}"
    )


def run_description(trainer: Any) -> str:
    """The line that starts a run: the model, the layout, the batch and the device."""
    t, c = trainer, trainer.config
    n = sum(p.numel() for chunk in t.chunks for p in chunk.parameters())
    peak = f"{t.peak / 1e12:.0f} TFLOP/s dense bf16" if t.peak else "n/a on CPU"
    ep = c.expert_model_parallel_size
    # Expert parallelism shards the experts' state over their expert-data-parallel ranks.
    experts = f", the experts' 1/{t.dp * c.context_parallel_size // ep}" if ep > 1 else ""
    return (
        f"megart train: GPT {c.num_layers} layers x {c.hidden_size} hidden, "
        f"{c.num_attention_heads} heads"
        + (f" in {c.num_query_groups} query groups" if c.group_query_attention else "")
        + (
            f" of multi-latent attention (kv rank {c.kv_lora_rank})"
            if c.multi_latent_attention
            else ""
        )
        + (f", {c.num_experts} experts top-{c.moe_router_topk}" if c.num_experts else "")
        + f", seq {c.seq_length}; tp {c.tp} x "
        + (f"cp {c.context_parallel_size} x " if c.context_parallel_size > 1 else "")
        + f"pp {c.pp} x "
        f"dp {t.dp}"
        + (f" (experts over ep {ep})" if ep > 1 else "")
        + f" (v {c.chunks}), global batch {c.global_batch_size} = "
        f"{t.m} microbatches of {c.micro_batch_size} per data-parallel rank"
        + (
            f" after a ramp-up from {c.rampup_batch_size[0]} by {c.rampup_batch_size[1]} "
            f"over {c.rampup_batch_size[2]} samples"
            if c.rampup_batch_size
            else ""
        )
        + "; "
        + (
            f"Adam state 1/{t.dp * c.context_parallel_size} per rank (distributed optimizer"
            f"{experts}); "
            if c.use_distributed_optimizer
            else ""
        )
        + f"{n:,} parameters on rank 0; device {t.device_name} (peak {peak})"
    )


def tensorboard_writer(directory: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"--tensorboard-dir needs the tensorboard package ({e}); "
            "pip install 'megart[tensorboard]' or leave the flag out"
        ) from e
    return SummaryWriter(log_dir=directory)


class RunLog(contextlib.ExitStack):
    """Where a run is reported, on rank 0 only: its lines on stdout (none when ``quiet``), each
    iteration's figures as a line of --log-jsonl and as scalars under --tensorboard-dir; and on
    every data-parallel rank 0 its GPU memory lines (``memory``, as Megatron-LM prints them)."""

    def __init__(
        self,
        config: Any,
        rank0: bool,
        quiet: bool,
        cpu: bool,
        memory: memory_report.MemoryLines | None = None,
    ) -> None:
        super().__init__()
        self.config, self.cpu, self.memory = config, cpu, memory
        self.printing = rank0 and not quiet
        self.jsonl = open(config.log_jsonl, "w") if config.log_jsonl and rank0 else None  # noqa: SIM115
        if self.jsonl is not None:
            self.callback(self.jsonl.close)
        self.board = None
        self.tags = dict(TENSORBOARD_TAGS)  # tag -> the figure's key
        if config.log_memory_to_tensorboard:
            self.tags.update(memory_report.TENSORBOARD_TAGS)
        if config.tensorboard_dir and rank0:
            self.board = tensorboard_writer(config.tensorboard_dir)
            self.callback(self.board.close)

    def say(self, line: str) -> None:
        if self.printing:
            print(line, flush=True)

    def record(self, fig: dict[str, Any]) -> None:
        """One iteration's figures: to the files, and its lines every --log-interval."""
        c = self.config
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(fig) + "\n")
            self.jsonl.flush()
        if self.board is not None:
            # Training figures every --tensorboard-log-interval iterations, evaluations always
            # (as Megatron-LM writes them).
            every = fig["iteration"] % c.tensorboard_log_interval == 0
            for tag, key in self.tags.items():
                if fig.get(key) is not None and (every or key.startswith(("valid_", "test_"))):
                    self.board.add_scalar(tag, fig[key], fig["iteration"])
            if every:  # --moe-per-layer-logging's values and the MTP depths' losses, under
                # their own (Megatron's) names
                for key in (k for k in fig if k.startswith(("moe/", "mtp_"))):
                    self.board.add_scalar(key, fig[key], fig["iteration"])
        logged = fig["iteration"] % c.log_interval == 0 or fig["iteration"] == 1
        if logged:
            self.say(progress_line(fig, c.train_iters, self.cpu))
        line = self.memory.line(fig, logged) if self.memory else None
        if line is not None:  # its own rule for which ranks print, so not say()
            print(line, flush=True)
        if fig.get("timers_ms"):
            self.say(timer_lines(fig["timers_ms"], c.timing_log_option))
            if self.board is not None and c.log_timers_to_tensorboard:
                for tag, ms in tensorboard_scalars(fig["timers_ms"]).items():
                    self.board.add_scalar(tag, ms, fig["iteration"])
        if "valid_loss" in fig:
            self.say(validation_line(fig))
        if "test_loss" in fig:
            self.say(validation_line(fig, "test"))
        if "exit" in fig:
            self.say(f"exiting after iteration {fig['iteration']}: {fig['exit']}")

    def finish(self, history: list[dict[str, Any]], seconds: float) -> None:
        c = self.config
        logs = ", ".join(x for x in (c.log_jsonl, c.tensorboard_dir) if x) or None
        self.say(summary_line(history, seconds, self.cpu, c.save, logs))
