"""What megart train refuses of --context-parallel-size, before any rank waits on another.

Context parallelism (megart.models.context_parallel) runs with tensor parallelism (and
sequence parallelism, which splits each rank's s/cp tokens over t), pipeline (1F1B,
interleaved, zb-h1, zb-v) and data parallelism, mixture-of-experts layers (models.moe: the
auxiliary losses' statistics over t x cp), multi-latent attention (models.mla, with every
--cp-comm-type), multi-token prediction (models.mtp: its shifts along the whole sequence,
models.mtp_sequence), the distributed optimizer, recomputation,
megart's own checkpoints, Megatron-LM's legacy files (distrib_optim.pt included) and its
torch_dist store (the weights' layout does not depend on cp, so a checkpoint resumes under any
cp; the distributed optimizer's state is sharded over d x cp and read back at any). What it has
not been built or tested with is refused by name.
"""

from __future__ import annotations

import math
from typing import Any

from megart.errors import ConfigError
from megart.models.config import CP_COMM_TYPES
from megart.models.context_parallel import check_divisible
from megart.parallel.layout import nearest_multiples

FLAG = "--context-parallel-size"


def check_context_parallel(config: Any) -> None:
    """Refuses a context-parallel size megart cannot run, naming the flags and what to change
    (megart train's checks and megart plan's, which models what train runs, MoE layers under
    context parallelism included)."""
    cp = config.context_parallel_size
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"{FLAG} {cp!r} must be a positive integer (1, the default: none)")
    if config.cp_comm_type not in CP_COMM_TYPES:
        # Megatron's hierarchical kind (all-to-all inside --hierarchical-context-parallel-sizes
        # groups, a ring across them) is not built; the other kinds give the same attention.
        raise ConfigError(
            f"--cp-comm-type {config.cp_comm_type}: megart's context parallelism passes keys "
            "and values around a ring (p2p, Megatron's default), all-gathers them (all_gather) "
            "or exchanges heads for the sequence all-to-all (a2a), with no hierarchical "
            "a2a+p2p; give --cp-comm-type p2p, all_gather or a2a (the attention is the same)"
        )
    if cp == 1:
        return
    if getattr(config, "reset_attention_mask", False):
        # Here rather than with the other document flags' checks (training.documents), so that
        # megart plan's context-parallel search, which runs these checks, refuses it too.
        raise ConfigError(
            f"--reset-attention-mask with {FLAG} {cp}: megart's context-parallel attention "
            "masks by global positions only, not by documents; use --context-parallel-size 1, "
            "or leave out --reset-attention-mask"
        )
    check_divisible(config.seq_length, cp, config.tp if config.sequence_parallel else 1)
    if config.cp_comm_type == "a2a":
        check_heads_split(config, cp)


def check_heads_split(config: Any, cp: int) -> None:
    """Under --cp-comm-type a2a each context-parallel rank attends with 1/cp of its tensor-
    parallel rank's heads and query groups (K/V heads): both must divide by cp."""
    heads = config.num_attention_heads // config.tp
    groups = (config.num_query_groups if config.group_query_attention else None) or (
        config.num_attention_heads
    )
    groups //= config.tp
    for what, n, flag in (("attention heads", heads, "--num-attention-heads"),
                          ("query groups", groups, "--num-query-groups")):  # fmt: skip
        if n % cp:
            raise ConfigError(
                f"--cp-comm-type a2a scatters each tensor-parallel rank's {n} "
                f"{what if n > 1 else what[:-1]} ({flag} / "
                f"--tensor-model-parallel-size {config.tp}) over --context-parallel-size {cp}: "
                f"they must divide by it; use --cp-comm-type p2p or all_gather, or {flag} a "
                f"multiple of {cp * config.tp}"
            )


def check_sequence_parallel_split(seq: int, tp: int, cp: int) -> None:
    """Sequence parallelism splits each context-parallel rank's s/cp tokens (cp chunks checked
    first: check_divisible) over the t tensor-parallel ranks: Megatron-Core's scatter to the
    sequence-parallel region asserts that t divides them. Else a ConfigError names the lengths
    that fit, multiples of t, and with cp > 1 of lcm(2 cp, cp t)."""
    if (seq // cp) % tp == 0:
        return
    unit = tp if cp == 1 else math.lcm(2 * cp, cp * tp)
    what = f"--seq-length {seq}"
    if cp > 1:
        what = f"each context-parallel rank's --seq-length {seq} / {FLAG} {cp} = {seq // cp} tokens"
    raise ConfigError(
        f"--sequence-parallel splits {what} over tensor-parallel size {tp} "
        f"(--tensor-model-parallel-size); it must divide: use --seq-length "
        f"{nearest_multiples(seq, unit)} (a multiple of {unit})"
    )
