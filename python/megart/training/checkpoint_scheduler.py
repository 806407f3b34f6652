"""Megatron-LM's --use-checkpoint-opt_param-scheduler: a resumed run follows the learning-rate
schedule saved in --load's checkpoint (Megatron's ``opt_param_scheduler`` state), not the one
its flags give.

Megatron-Core's OptimizerParamScheduler.load_state_dict then takes each saved value (peak and
floor rate, warm-up and decay steps, decay style, weight decay) in place of its own, and the
optimizer's loaded param groups bring back their saved peak and floor (--decoupled-lr's group
too). megart computes every rate from its TrainConfig, so the saved values become the run's
flags before anything reads them, each said on rank 0 as --use-checkpoint-args says its own.
The scheduler counts samples: its steps turn into this run's iterations of --global-batch-size
(or stay samples under --train-samples).

Where Megatron-LM loads no scheduler the flags' schedule runs, as there: a restartable job's
first run (--load holding no checkpoint yet) and its start from --pretrained-checkpoint.
Where the flag cannot take effect megart refuses it rather than ignore it: with --finetune or
--no-load-optim (Megatron-LM loads no scheduler and goes on with the flags), with
--override-opt_param-scheduler (Megatron-Core asserts the two exclude each other), on a
checkpoint that holds no scheduler state (a release checkpoint, megart's own format before
2026-11-29: its files now record Megatron's scheduler state too), and where
a rising weight decay was saved over another run length than this one (megart's rise spans the
run's --train-iters; Megatron's would keep the saved span). WSD's anneal (--lr-wsd-decay-iters,
--lr-wsd-decay-style) is not in the saved state: it comes from the flags, as in Megatron-LM.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from megart.errors import ConfigError
from megart.training.checkpoint_args import checkpoint_records
from megart.training.checkpoint_dirs import loads_pretrained, no_checkpoint_yet, resume_dir
from megart.training.megatron_scheduler import saved_value, scheduler_state

FLAG = "--use-checkpoint-opt_param-scheduler"


def with_saved_schedule(config: Any) -> Any:
    """``config`` (a TrainConfig) with the learning-rate schedule of the checkpoint it resumes
    when --use-checkpoint-opt_param-scheduler is given (and the checkpoint is loaded with its
    scheduler); otherwise ``config`` itself."""
    if not config.use_checkpoint_opt_param_scheduler:
        return config
    for flag, given in (("--override-opt_param-scheduler", config.override_opt_param_scheduler),
                        ("--finetune", config.finetune),
                        ("--no-load-optim", config.no_load_optim)):  # fmt: skip
        if given:
            raise ConfigError(
                f"{FLAG} with {flag}: "
                + (
                    "the two exclude each other (Megatron-Core asserts it); give one"
                    if flag.startswith("--override")
                    else "no scheduler state is loaded then (Megatron-LM goes on with the flags' "
                    f"schedule); leave {FLAG} out"
                )  # fmt: skip
            )
    if not config.load and not config.pretrained_checkpoint:
        raise ConfigError(f"{FLAG} takes the schedule from --load's checkpoint: give --load DIR")
    if loads_pretrained(config.load, config.pretrained_checkpoint) or no_checkpoint_yet(
        config.load
    ):
        return config  # nothing resumed: this run starts the schedule its flags give
    load = resume_dir(config)
    records, where, _ = checkpoint_records(load, config.ckpt_step)
    # Megatron's formats' state, or megart's own record of it (since 2026-11-29).
    state = records.get("opt_param_scheduler") or records.get("scheduler")
    if records.get("release") or state is None:
        raise ConfigError(
            f"{FLAG}: {where} holds no learning-rate scheduler state (a release checkpoint, or "
            "megart's own format written before 2026-11-29); leave the flag out and give the "
            "schedule's flags (--lr, --min-lr, --lr-warmup-iters, --lr-decay-iters, "
            "--lr-decay-style, --weight-decay)"
        )
    values = schedule_flags(state, config, where)
    args = records.get("args")
    if args is not None:  # Megatron-LM restores --decoupled-lr's group from its saved groups
        saved = vars(args)
        for field in ("decoupled_lr", "decoupled_min_lr"):
            if field in saved:
                values[field] = saved[field]
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{FLAG}: the learning-rate schedule from {where}", flush=True)
        for field, value in values.items():
            if value != getattr(config, field):
                print(f"Setting {field} to {value} from checkpoint", flush=True)
    return dataclasses.replace(config, **values)


def schedule_flags(state: dict[str, Any], config: Any, where: str) -> dict[str, Any]:
    """The TrainConfig fields that give Megatron's saved scheduler ``state`` for a run of
    ``config``'s batch: the rates, the style and the weight decay as saved, the warm-up and
    decay steps (samples) in this run's units."""
    start_wd, end_wd = saved_value(state, "start_wd"), saved_value(state, "end_wd")
    style = saved_value(state, "wd_incr_style") or "constant"
    rising = dict(start_weight_decay=start_wd, end_weight_decay=end_wd)
    if style == "constant":  # Megatron's start and end are then --weight-decay
        rising = dict.fromkeys(rising)
    else:  # megart's rise spans this run: it must be the saved one's
        steps = saved_value(state, "wd_incr_steps")
        run = scheduler_state(config, 0)["wd_incr_steps"]  # what this run would save
        if steps is not None and steps != run:
            raise ConfigError(
                f"{FLAG}: {where} raises the weight decay over {steps} samples and this run "
                f"lasts {run}; give --train-iters (or --train-samples) as the run that wrote "
                "it did"
            )
    warmup = saved_value(state, "lr_warmup_steps")
    decay = saved_value(state, "lr_decay_steps")
    if saved_value(state, "lr_decay_style") == "WSD" and config.anneal_iters is None:
        raise ConfigError(
            f"{FLAG}: {where} holds a WSD schedule, whose anneal length Megatron's scheduler "
            "state does not keep (Megatron-LM takes it from the flags): give "
            "--lr-wsd-decay-iters (or --lr-wsd-decay-samples) as the run that wrote it did"
        )
    values: dict[str, Any] = dict(
        lr=saved_value(state, "max_lr"),
        min_lr=saved_value(state, "min_lr"),
        lr_decay_style=saved_value(state, "lr_decay_style"),
        weight_decay=start_wd,
        weight_decay_incr_style=style,
        **rising,
        lr_warmup_fraction=None,
        lr_warmup_iters=0,
        lr_warmup_samples=0,
        lr_decay_iters=None,
        lr_decay_samples=None,
    )
    if config.train_samples is not None:  # counted in samples, as the scheduler counts
        values["lr_decay_samples"] = int(decay)
        unit = 1
    else:
        gbs = config.global_batch_size
        if decay % gbs:
            raise ConfigError(
                f"{FLAG}: {where} decays over {decay} samples, which is no whole number of "
                f"this run's global batches of {gbs}: give --global-batch-size a divisor of "
                f"{decay}, or --train-samples"
            )
        values["lr_decay_iters"] = int(decay // gbs)
        unit = gbs
    if warmup % unit == 0:
        key = "lr_warmup_samples" if unit == 1 else "lr_warmup_iters"
        values[key] = int(warmup // unit)
    else:  # a --lr-warmup-fraction's unrounded steps, or a batch that does not divide them
        values["lr_warmup_fraction"] = warmup / decay
    return values
