"""Context parallelism's all-to-all exchange (--cp-comm-type a2a, megart's
models.all_to_all_attention) as megart plan counts it.

Per layer and microbatch each rank of the cp group runs, forward, one all-to-all per tensor
that attention hands it: q ([b, heads/t, s/cp, d]), k and v ([b, groups/t, s/cp, d], before any
repetition per head), which leave it holding heads/(t cp) heads of the whole sequence, and one
more that returns the attention output (q's size) as its own s/cp tokens of every head. Each
exchange is megart's AllToAll autograd function, whose backward is the same exchange reversed:
four more backward (the output's gradient, then those of q, k and v). Recomputation replays
forward ones in the backward: full recomputation the layer's four; selective recomputation's
checkpoint (models.attention's _core) the first three only, for torch's non-reentrant
checkpoint stops replaying once every tensor it saved is back (its early stop, on by default):
the attention kernel's saves are the checkpoint's last, and the output's exchange comes after
them (counted on a real megart train step: tests/test_plan_a2a.py).

The cost of one: each rank cuts its buffer into cp pieces and sends piece j to group rank j,
all posted together (one latency). The group's ranks sit t apart (megart train places ranks
tp-cp-dp-pp), so a node holds k of them (hardware.group_ranks_per_node): k - 1 pieces
cross NVLink, the cp - k others leave over the rank's own rail (its NIC), both at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from megart.models.config import GPTConfig
from megart.plan.hardware import GPUProfile, group_ranks_per_node


@dataclass(frozen=True)
class Exchanges:
    """Elements of each all-to-all's buffer on one rank (what it cuts into cp pieces), in the
    order the runtime posts them, for one layer and one microbatch."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    replayed: tuple[float, ...]  # recomputation's replay of the forward ones, in the backward

    @property
    def all(self) -> tuple[float, ...]:
        return self.forward + self.backward + self.replayed


def a2a_exchanges(cfg: GPTConfig, b: int, tp: int, cp: int, recompute: str | None) -> Exchanges:
    """The all-to-alls of one layer and microbatch on a rank of ``cp`` (see the module's
    docstring); none without context parallelism."""
    if cp <= 1:
        return Exchanges((), (), ())
    tokens = cfg.seq_length // cp * b
    q = tokens * cfg.num_attention_heads * cfg.head_dim / tp
    kv = tokens * cfg.query_groups * cfg.head_dim / tp
    forward = (q, kv, kv, q)  # q, k, v in; the output back
    backward = (q, q, kv, kv)  # the output's gradient, then dq, dk, dv
    replayed = {"full": forward, "selective": forward[:3]}.get(recompute or "", ())
    return Exchanges(forward, backward, replayed)


def a2a_seconds(nbytes: float, cp: int, tp: int, gpu: GPUProfile) -> float:
    """One all-to-all of an ``nbytes`` buffer on each of ``cp`` ranks placed t apart (see the
    module's docstring): its NVLink and rail pieces at once, one latency."""
    if cp <= 1 or nbytes <= 0:
        return 0.0
    near = group_ranks_per_node(gpu, tp, cp)
    piece = nbytes / cp
    inside = (near - 1) * piece / (gpu.nvlink_bus_gb_per_s * 1e9)
    across = (cp - near) * piece / (gpu.rail_gb_per_s * 1e9)
    return max(inside, across) + gpu.link_latency_us * 1e-6


def a2a_layer_seconds(
    cfg: GPTConfig,
    b: int,
    tp: int,
    cp: int,
    recompute: str | None,
    gpu: GPUProfile,
    element_bytes: float,
) -> tuple[float, float, float]:
    """Seconds of one layer's all-to-alls for one microbatch: forward, backward, and the
    replay that recomputation adds to the backward (``element_bytes`` per element)."""
    ex = a2a_exchanges(cfg, b, tp, cp, recompute)

    def total(sizes: tuple[float, ...]) -> float:
        return sum(a2a_seconds(n * element_bytes, cp, tp, gpu) for n in sizes)

    return total(ex.forward), total(ex.backward), total(ex.replayed)
