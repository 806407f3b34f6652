"""The rank grid as a pure function: (world size, tp, pp, dp, order, gpus per node) -> which rank
sits where and which ranks form each group. No processes, no torch.

A rank's coordinates are (tp_rank, pp_rank, dp_rank), and ``cp_rank_of`` its context-parallel
rank. ``order`` names the dimensions
from the innermost (adjacent ranks) to the outermost. Megatron's order, the default, is
"tp-dp-pp":

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so a tensor-parallel group is ``tp`` consecutive ranks (one node, NVLink) and pipeline stages
are ``tp * dp`` ranks apart.

Context parallelism (``cp`` ranks splitting each sequence) sits just inside data parallelism,
wherever the order puts "dp", as in Megatron's default tp-cp-ep-dp-pp: the "dp" slot of the
order holds cp x dp ranks, cp innermost. With cp = 1 every rank sits where it did without it.

Rails: a rank's rail is its local index on its node (``rank % gpus_per_node``); each GPU of a
node has its own network card, and a rail-optimised network connects the same card of every
node. A pipeline hop between two nodes should stay on one rail, so every layout here keeps
pipeline peers on different nodes on the same rail; hops inside a node use NVLink, not a rail.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations
from typing import Literal, NamedTuple

from megart.errors import ConfigError

DIMS = ("tp", "dp", "pp")
DEFAULT_ORDER = "tp-dp-pp"
ORDERS = tuple("-".join(p) for p in permutations(DIMS))
GroupKind = Literal["tp", "pp", "dp", "mp", "embedding", "cp", "dp_cp", "ep", "edp"]
GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp", "mp", "embedding")
# Made only when cp > 1: with cp = 1 the cp groups are single ranks and dp x cp is dp.
CP_GROUP_KINDS: tuple[GroupKind, ...] = ("cp", "dp_cp")


class Coords(NamedTuple):
    tp_rank: int
    pp_rank: int
    dp_rank: int


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def either(values: list[int]) -> str:
    """Values as a refusal offers them: "4", "2 or 4", "1, 2 or 4"."""
    *others, last = values
    return f"{', '.join(map(str, others))} or {last}" if others else str(last)


def nearest_multiples(n: int, unit: int) -> str:
    """The multiples of ``unit`` nearest ``n`` (which is not one), for a refusal: the one
    below, when there is one, and the one above."""
    below = n // unit * unit
    return either([m for m in (below, below + unit) if m])


def _join(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


def _size_hint(world_size: int, tp: int, pp: int) -> str:
    """What would fit when tp * pp does not divide the world: tp for this pp, pp for this tp."""
    hints = []
    for name, fixed, other in (("pp", pp, "tp"), ("tp", tp, "pp")):
        if world_size % fixed:
            hints.append(f"{name}={fixed} does not divide world_size={world_size} either")
        else:
            hints.append(
                f"with {name}={fixed}, {other} can be one of {_join(divisors(world_size // fixed))}"
            )
    return "; ".join(hints)


@dataclass(frozen=True)
class GridLayout:
    """Where every rank sits. ``make_layout`` builds one with defaults filled in; construction
    checks it either way, so a GridLayout that exists is a valid one."""

    world_size: int
    tp: int
    pp: int
    dp: int
    order: str
    gpus_per_node: int
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "dp", "gpus_per_node", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.order not in ORDERS:
            raise ConfigError(
                f"order {self.order!r} is not a layout order; use one of {', '.join(ORDERS)} "
                f"(innermost first; {DEFAULT_ORDER!r} is Megatron's, and tp innermost keeps "
                "tensor-parallel groups inside a node)"
            )
        used = self.tp * self.pp * self.dp * self.cp
        if used != self.world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            message = (
                f"tp={self.tp}{cp} x pp={self.pp} x dp={self.dp} = {used} ranks, but world_size "
                f"is {self.world_size}; "
            )
            if self.world_size % (self.tp * self.pp * self.cp) == 0:
                message += (
                    f"dp={self.world_size // (self.tp * self.pp * self.cp)} fits "
                    f"(world_size / (tp x{cp[3:]} pp)), or leave dp unset to derive it"
                )
            else:
                message += "tp x pp must divide world_size: " + _size_hint(
                    self.world_size, self.tp, self.pp
                )
            raise ConfigError(message)
        problem = _rail_problem(self.world_size, self._sizes(), self.order, self.gpus_per_node)
        if problem:
            fits = [
                repr(o)
                for o in ORDERS
                if o != self.order
                and not _rail_problem(self.world_size, self._sizes(), o, self.gpus_per_node)
            ]
            # Suggest only tp-innermost orders when any fits: the others spread a
            # tensor-parallel group over nodes.
            fits = [o for o in fits if o.startswith("'tp")] or fits
            hint = (
                f"orders that keep it with these sizes: {', '.join(fits)}"
                if fits
                else "no order keeps it with these sizes; change tp, pp or dp"
            )
            raise ConfigError(f"{problem}; {hint}")

    # Geometry. The order's "dp" slot holds cp x dp ranks (cp inside), see the module's doc.
    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp * self.cp}

    def size(self, dim: str) -> int:
        return self.cp if dim == "cp" else self.dp if dim == "dp" else self._sizes()[dim]

    def stride(self, dim: str) -> int:
        """How many ranks apart two neighbours along ``dim`` are."""
        if dim == "cp":
            return _stride(self.order, self._sizes(), "dp")
        return _stride(self.order, self._sizes(), dim) * (self.cp if dim == "dp" else 1)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside world_size={self.world_size}")

    def coords(self, rank: int) -> Coords:
        """(tp_rank, pp_rank, dp_rank) of a global rank."""
        self._check_rank(rank)
        return Coords(*(self._index(d, rank) for d in ("tp", "pp", "dp")))

    def cp_rank_of(self, rank: int) -> int:
        """The context-parallel rank of a global rank (0 when cp = 1)."""
        self._check_rank(rank)
        return self._index("cp", rank)

    def _index(self, dim: str, rank: int) -> int:
        return (rank // self.stride(dim)) % self.size(dim)

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int, cp_rank: int = 0) -> int:
        """The global rank at these coordinates (the inverse of ``coords``)."""
        rank = 0
        for dim, value in (("tp", tp_rank), ("pp", pp_rank), ("dp", dp_rank), ("cp", cp_rank)):
            if not 0 <= value < self.size(dim):
                raise ConfigError(f"{dim}_rank={value} is outside {dim}={self.size(dim)}")
            rank += value * self.stride(dim)
        return rank

    # Groups. Each is a tuple of global ranks in group-rank order; lists of groups are sorted
    # by their first rank, so every process enumerates them identically.
    def _along(self, dim: str, rank: int) -> tuple[int, ...]:
        stride = self.stride(dim)
        base = rank - self._index(dim, rank) * stride
        return tuple(base + i * stride for i in range(self.size(dim)))

    def group_of(self, kind: GroupKind, rank: int) -> tuple[int, ...] | None:
        """The ranks of ``rank``'s group of this kind: "tp", "pp", "dp", "cp", "dp_cp" (the
        dp x cp ranks that hold one model piece and average its gradients, Megatron's data
        parallel group with context parallelism), "mp" (the tp x pp ranks holding one model
        replica, ascending) or "embedding" (the first and last stage of its pipeline, which
        share the tied word embedding; None for a middle stage)."""
        if kind in ("tp", "pp", "dp", "cp"):
            return self._along(kind, rank)
        c, cp_rank = self.coords(rank), self.cp_rank_of(rank)
        if kind == "dp_cp":
            return tuple(
                sorted(
                    self.rank_of(c.tp_rank, c.pp_rank, d, k)
                    for d in range(self.dp)
                    for k in range(self.cp)
                )
            )
        if kind == "mp":
            return tuple(
                sorted(
                    self.rank_of(t, p, c.dp_rank, cp_rank)
                    for t in range(self.tp)
                    for p in range(self.pp)
                )
            )
        if kind == "embedding":
            pipeline = self._along("pp", rank)
            ends = (pipeline[0], pipeline[-1]) if self.pp > 1 else (pipeline[0],)
            return ends if rank in ends else None
        kinds = ", ".join(GROUP_KINDS + CP_GROUP_KINDS)
        raise ConfigError(f"unknown group kind {kind!r}; use one of {kinds}")

    def groups(self, kind: GroupKind) -> list[tuple[int, ...]]:
        """Every group of this kind, each once, sorted by first rank."""
        found: dict[int, tuple[int, ...]] = {}
        for rank in range(self.world_size):
            group = self.group_of(kind, rank)
            if group is not None:
                found.setdefault(group[0], group)
        return [found[first] for first in sorted(found)]

    # Pipeline peers.
    def prev_pp_rank(self, rank: int) -> int | None:
        """The rank of the previous pipeline stage, or None on the first stage."""
        pp_rank = self.coords(rank).pp_rank
        return None if pp_rank == 0 else rank - self.stride("pp")

    def next_pp_rank(self, rank: int) -> int | None:
        """The rank of the next pipeline stage, or None on the last stage."""
        pp_rank = self.coords(rank).pp_rank
        return None if pp_rank == self.pp - 1 else rank + self.stride("pp")

    def pp_ring_neighbours(self, rank: int) -> tuple[int, int]:
        """(previous, next) pipeline ranks with wrap-around: interleaved schedules send the last
        stage's chunk output on to the first stage's next chunk. (rank, rank) when pp is 1."""
        pipeline = self._along("pp", rank)
        i = pipeline.index(rank)
        return pipeline[i - 1], pipeline[(i + 1) % self.pp]

    # Nodes and rails.
    def node(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.gpus_per_node

    def rail(self, rank: int) -> int:
        """The rank's local index on its node, which names its network card."""
        self._check_rank(rank)
        return rank % self.gpus_per_node


def _stride(order: str, sizes: dict[str, int], dim: str) -> int:
    stride = 1
    for inner in order.split("-"):
        if inner == dim:
            return stride
        stride *= sizes[inner]
    raise ConfigError(f"unknown dimension {dim!r}; use one of {', '.join(DIMS)}")


def _rail_problem(world_size: int, sizes: dict[str, int], order: str, g: int) -> str | None:
    """Why a pipeline hop between nodes would change rail, or None when none does.

    Pipeline peers are a fixed stride apart, and two ranks a stride apart share a rail only
    when the stride is a multiple of gpus_per_node; otherwise every pipeline must stay inside
    one node (its hops, wrap-around included, then never use a rail)."""
    pp, stride = sizes["pp"], _stride(order, sizes, "pp")
    if pp == 1 or stride % g == 0:
        return None
    for first in range(world_size):
        if (first // stride) % pp:
            continue  # not a first stage
        last = first + (pp - 1) * stride
        if first // g == last // g:
            continue
        a = next(r for r in range(first, last, stride) if r // g != (r + stride) // g)
        inner = order.split("-")[: order.split("-").index("pp")]
        apart = " x ".join(inner) + f" = {stride}" if inner else "1"
        return (
            f"pipeline peers {a} and {a + stride} are on different nodes (gpus_per_node={g}) "
            f"but on different rails ({a % g} and {(a + stride) % g}): with order {order!r}, "
            f"pipeline stages are {apart} ranks apart, which must be a multiple of "
            f"gpus_per_node={g}, or each pipeline must fit in one node"
        )
    return None


def make_layout(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    order: str = DEFAULT_ORDER,
    gpus_per_node: int | None = None,
    cp: int = 1,
) -> GridLayout:
    """The checked layout of ``world_size`` ranks. ``dp`` None derives it as
    world_size / (tp x pp x cp); ``gpus_per_node`` None means one node holds every rank."""
    if dp is None:
        sizes = (tp, pp, cp)
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
            if world_size % (tp * pp * cp):
                if cp > 1:
                    raise ConfigError(
                        f"tp={tp} x pp={pp} x cp={cp} = {tp * pp * cp} does not divide "
                        f"world_size={world_size}, so no dp fits; change tp, pp or cp"
                    )
                raise ConfigError(
                    f"tp={tp} x pp={pp} = {tp * pp} does not divide world_size={world_size}, "
                    f"so no dp fits: " + _size_hint(world_size, tp, pp)
                )
            dp = world_size // (tp * pp * cp)
        else:
            dp = 1  # GridLayout names the bad tp, pp or cp
    return GridLayout(
        world_size, tp, pp, dp, order, world_size if gpus_per_node is None else gpus_per_node, cp
    )
