"""Context parallelism's exchanges as megart plan counts them: what one rank posts per layer and
microbatch under each --cp-comm-type, forward, backward, and replayed in the backward by
recomputation (each counted on real megart train steps: tests/test_plan_a2a.py,
tests/test_plan_cp_exchanges.py); the all-to-all's time too (the ring's and the all-gather's
collectives are timed in plan.timing).

Multi-latent attention exchanges its own widths (plan.mla_cp.cp_kv_widths): keys per head
(heads/t of them) qk_head_dim + qk_pos_emb_head_dim wide, values v_head_dim, the queries as
the keys and the output as the values; the ring pads the values to the keys' width.

The ring (p2p, models.ring_attention): cp - 1 passes forward of the rank's K/V block (k and v
of its s/cp tokens, groups/t heads: 2 b s/cp groups/t d 16-bit elements) to the next rank;
backward cp - 1 such passes and cp of the dK/dV accumulators (the block's size, fp32). Both
recomputations replay the cp - 1 forward passes: the ring runs inside selective recomputation's
checkpoint (models.attention's _core), and its saves (ctx.save_for_backward) come after its
last pass, so torch's early stop comes too late to skip any.

The all-gather (all_gather, models.context_parallel's gather_kv): two all-gathers forward (K
and V, each gathered to b s groups/t d elements), two reduce-scatters of their gradients
backward; full recomputation replays the two all-gathers, selective none (they run before its
checkpoint, which gets the gathered K/V as inputs; MLA's run inside it: replayed).

The all-to-all (a2a, models.all_to_all_attention): per layer and microbatch each rank of the cp
group runs, forward, one all-to-all per tensor that attention hands it: q ([b, heads/t, s/cp,
d]), k and v ([b, groups/t, s/cp, d], before any repetition per head), which leave it holding
heads/(t cp) heads of the whole sequence, and one more that returns the attention output (q's
size) as its own s/cp tokens of every head. Each exchange is megart's AllToAll autograd
function, whose backward is the same exchange reversed: four more backward (the output's
gradient, then those of q, k and v). Recomputation replays forward ones in the backward: full
recomputation the layer's four; selective recomputation's checkpoint (models.attention's _core)
the first three only, for torch's non-reentrant checkpoint stops replaying once every tensor it
saved is back (its early stop, on by default): the attention kernel's saves are the
checkpoint's last, and the output's exchange comes after them (counted on a real megart train
step: tests/test_plan_a2a.py).

The cost of one: each rank cuts its buffer into cp pieces and sends piece j to group rank j,
all posted together (one latency). The group's ranks sit t apart (megart train places ranks
tp-cp-dp-pp), so a node holds k of them (hardware.group_ranks_per_node): k - 1 pieces
cross NVLink, the cp - k others leave over the rank's own rail (its NIC), both at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from megart.models.config import GPTConfig
from megart.plan.hardware import GPUProfile, group_ranks_per_node
from megart.plan.mla_cp import cp_kv_widths


@dataclass(frozen=True)
class RingPasses:
    """The blocks one rank of the ring passes to the next for one layer and microbatch (see
    the module's docstring): each ``block`` elements (its K and V); 16-bit ``forward``,
    ``backward`` and ``replayed`` passes of K/V, and ``grads`` passes of fp32 dK/dV."""

    block: float
    forward: int
    backward: int
    grads: int
    replayed: int


def ring_passes(cfg: GPTConfig, b: int, tp: int, cp: int, recompute: str | None) -> RingPasses:
    """The ring's passes of one layer and microbatch on a rank of ``cp`` (none without context
    parallelism); recomputation, full or selective, replays the forward ones."""
    if cp <= 1:
        return RingPasses(0.0, 0, 0, 0, 0)
    heads, k, v = cp_kv_widths(cfg)  # narrower values travel padded to the keys' width
    block = (cfg.seq_length // cp) * b * heads * (k + max(k, v)) / tp
    return RingPasses(block, cp - 1, cp - 1, cp, cp - 1 if recompute else 0)


@dataclass(frozen=True)
class Gathers:
    """The all-gather exchange's collectives of one layer and microbatch (see the module's
    docstring): ``keys`` and ``values`` elements of the gathered K and V over the whole
    sequence (1/cp of each the rank's own), and of each ``forward`` all-gathers, ``backward``
    reduce-scatters of their gradients, ``replayed`` all-gathers that recomputation replays."""

    keys: float
    values: float
    forward: int
    backward: int
    replayed: int


def kv_gathers(cfg: GPTConfig, b: int, tp: int, cp: int, recompute: str | None) -> Gathers:
    """The all-gather exchange's collectives on a rank of ``cp`` (none without context
    parallelism); full recomputation replays the two all-gathers, selective none but MLA's."""
    if cp <= 1:
        return Gathers(0.0, 0.0, 0, 0, 0)
    heads, k, v = cp_kv_widths(cfg)
    whole = cfg.seq_length * b * heads / tp
    # MLA runs its gathers inside selective recomputation's checkpoint (models.mla's core).
    replays = recompute == "full" or (recompute == "selective" and cfg.multi_latent_attention)
    return Gathers(whole * k, whole * v, 1, 1, 1 if replays else 0)


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
    tokens = cfg.seq_length // cp * b / tp
    heads, kw, vw = cp_kv_widths(cfg)
    q, o = (tokens * cfg.num_attention_heads * w for w in (kw, vw))  # the output: v wide
    k, v = tokens * heads * kw, tokens * heads * vw
    forward = (q, k, v, o)  # q, k, v in; the output back
    backward = (o, q, k, v)  # the output's gradient, then dq, dk, dv
    replayed = {"full": forward, "selective": forward[:3]}.get(recompute or "", ())
    return Exchanges(forward, backward, replayed)


def a2a_seconds(nbytes: float, cp: int, tp: int, gpu: GPUProfile) -> float:
    """One all-to-all of an ``nbytes`` buffer on each of ``cp`` ranks placed t apart (see the
    module's docstring): its NVLink and rail pieces at once, one latency."""
    return all_to_all_seconds(nbytes, cp, group_ranks_per_node(gpu, tp, cp), gpu)


def all_to_all_seconds(nbytes: float, n: int, near: int, gpu: GPUProfile) -> float:
    """One all-to-all of an ``nbytes`` send buffer on each of ``n`` ranks, ``near`` of them
    (the rank counted) in the node of the worst-placed one: its pieces of nbytes / n to the
    near - 1 node mates over NVLink and to the n - near others over its own rail at once, one
    latency (expert parallelism's too: plan.moe_time)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    piece = nbytes / n
    inside = (near - 1) * piece / (gpu.nvlink_bus_gb_per_s * 1e9)
    across = (n - near) * piece / (gpu.rail_gb_per_s * 1e9)
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
