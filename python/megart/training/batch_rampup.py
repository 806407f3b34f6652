"""Megatron-LM's batch-size ramp-up, --rampup-batch-size START INCREMENT SAMPLES.

The global batch starts at START and grows by INCREMENT up to --global-batch-size, in
K = (global - START) / INCREMENT steps spread evenly over SAMPLES consumed samples: an iteration
that starts with ``consumed`` samples already trained takes

    global batch = --global-batch-size                                  if consumed > SAMPLES
                 = START + int(consumed / (SAMPLES / K)) x INCREMENT    otherwise

samples (Megatron-Core's RampupBatchsizeNumMicroBatchesCalculator, the same float arithmetic),
that is global batch / (--micro-batch-size x data-parallel size) microbatches per rank. The
learning-rate schedule counts samples (Megatron's scheduler steps by each iteration's batch),
the checkpoint records the consumed samples, and with --train-samples the iterations are
Megatron's update_train_iters: the ramp's iterations until it has consumed SAMPLES (or
--train-samples), then whole global batches of what is left.

Where megart differs: Megatron refuses the ramp with --train-iters ("expected no batch-size
rampup for iteration-based training"), although its GPT-3 175B example script gives both;
megart runs --train-iters iterations of the ramp, with the schedule in samples as Megatron's
scheduler counts them under --train-iters (--lr-decay-iters x --global-batch-size samples).
Megatron checks each batch against the micro batch and data-parallel sizes as it comes, and
the interleaved and zb-v schedules' microbatch counts when it runs them; megart refuses a ramp
whose batches would not fit before any work. Megatron's --decrease-batch-size-if-needed is not
one of megart's flags (argparse refuses it by name).
"""

from __future__ import annotations

from typing import Any

from megart.errors import ConfigError

FLAG = "--rampup-batch-size"


def _values(config: Any) -> tuple[int, int, int]:
    start, increment, samples = config.rampup_batch_size
    return int(start), int(increment), int(samples)


def check_values(config: Any) -> None:
    """Refuses ramp values Megatron refuses (or fails on), naming them; needs no layout."""
    ramp = config.rampup_batch_size
    if ramp is None:
        return
    if len(ramp) != 3:
        raise ConfigError(
            f"{FLAG} takes three numbers, START INCREMENT SAMPLES (got {len(ramp)}): the first "
            "global batch, its increment, and the samples over which it grows"
        )
    start, increment, samples = _values(config)
    gbs = config.global_batch_size
    if start < 1 or increment < 1 or samples < 1:
        raise ConfigError(
            f"{FLAG} {start} {increment} {samples}: the start batch, the increment and the "
            "ramp-up samples must be at least 1"
        )
    if start >= gbs:
        raise ConfigError(
            f"{FLAG} {start} {increment} {samples}: the start batch must be below "
            f"--global-batch-size {gbs} (the batch it ramps up to); leave {FLAG} out for a "
            "constant batch"
        )
    if (gbs - start) % increment:
        fits = [d for d in range(1, gbs - start + 1) if (gbs - start) % d == 0]
        raise ConfigError(
            f"{FLAG} {start} {increment} {samples}: --global-batch-size {gbs} - start {start} = "
            f"{gbs - start} is not a multiple of the increment {increment}; increments that "
            f"fit: {', '.join(map(str, fits[:12]))}"
        )


def batch_size(config: Any, consumed: int) -> int:
    """The global batch of the iteration that starts after ``consumed`` samples."""
    if config.rampup_batch_size is None:
        return config.global_batch_size
    start, increment, samples = _values(config)
    if consumed > samples:
        return config.global_batch_size
    per_increment = samples / ((config.global_batch_size - start) // increment)
    return start + int(consumed / per_increment) * increment


def train_iters(config: Any) -> int:
    """Iterations of --train-samples under the ramp (Megatron's update_train_iters): the
    ramp's iterations while the samples consumed are at most the ramp-up samples and at most
    --train-samples, then whole global batches of the rest (a partial last batch is not
    trained)."""
    _, _, samples = _values(config)
    consumed = iterations = 0
    while consumed <= samples and consumed <= config.train_samples:
        consumed += batch_size(config, consumed)
        iterations += 1
    if config.train_samples > consumed:
        iterations += (config.train_samples - consumed) // config.global_batch_size
    return iterations


def check_rampup(config: Any, dp: int) -> None:
    """Refuses, before any work, a ramp whose batches do not split into microbatches of this
    layout or whose microbatch counts the pipeline schedule cannot run, saying what fits."""
    if config.rampup_batch_size is None:
        return
    check_values(config)
    start, increment, samples = _values(config)
    mbs, pp = config.micro_batch_size, config.pp
    q = mbs * dp
    if start % q or increment % q:
        raise ConfigError(
            f"{FLAG} {start} {increment} {samples}: the start batch and the increment must be "
            f"multiples of --micro-batch-size {mbs} x data-parallel size {dp} = {q} (every "
            f"global batch of the ramp splits into microbatches on every rank), e.g. "
            f"{FLAG} {max(q, start // q * q)} {max(q, increment // q * q)} {samples} (with "
            "--global-batch-size a multiple of the increment above the start)"
        )
    first, step = start // q, increment // q  # microbatches of the first batch, and per step
    if config.schedule == "interleaved" and (first % pp or step % pp):
        raise ConfigError(
            f"{FLAG} {start} {increment} {samples}: the interleaved schedule needs every "
            f"iteration's number of microbatches to be a multiple of the pipeline size {pp} "
            f"(Megatron fails at the first one that is not), but the ramp runs {first}, then "
            f"{first + step}, ... microbatches; make the start and the increment multiples of "
            f"{q} x {pp} = {q * pp}"
        )
    if config.schedule == "zb-v" and first < 2 * pp:
        raise ConfigError(
            f"{FLAG} {start} {increment} {samples}: --pipeline-schedule zb-v needs at least 2 x "
            f"pipeline size = {2 * pp} microbatches, but the ramp's first batch gives {first}; "
            f"start at {2 * pp * q} or more, or use zb-h1"
        )
