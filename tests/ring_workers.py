"""Ring attention (--cp-comm-type p2p) checks that run on every rank of a launched test (module
level, so spawn can import them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import megart.distributed as dist
from megart.models.all_to_all_attention import all_to_all_attention
from megart.models.attention import Attention
from megart.models.config import GPTConfig
from megart.models.context_parallel import split_for_cp
from megart.models.ring_attention import TILE_ELEMENTS, block_of, ring_attention

F64 = torch.float64


def reference(q, k, v, dy, window=None):
    """One process, float64: causal attention of the whole sequence (torch's own kernel, each
    group's K/V repeated per head; with a sliding ``window`` key j seen by query i when
    i - window <= j <= i), its output and the gradients of q, k, v for ``dy``."""
    per_group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    kk, vv = k.repeat_interleave(per_group, 1), v.repeat_interleave(per_group, 1)
    if window is None:
        y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    else:
        i, j = torch.arange(q.shape[2]).unsqueeze(1), torch.arange(q.shape[2]).unsqueeze(0)
        y = F.scaled_dot_product_attention(q, kk, vv, (j <= i) & (j >= i - window))
    y.backward(dy)
    return y.detach(), q.grad, k.grad, v.grad


def draw(case: dict, cp: int) -> list[torch.Tensor]:
    """Seeded float64 q [b, heads, s, d], k, v [b, groups, s, d] and an output gradient."""
    g = torch.Generator().manual_seed(case["seed"])
    b, heads, groups, d = case["b"], case["heads"], case["groups"], case["d"]
    s = 2 * cp * case["half"]
    shapes = [(b, heads, s, d), (b, groups, s, d), (b, groups, s, d), (b, heads, s, d)]
    return [torch.randn(shape, generator=g, dtype=F64) for shape in shapes]


def ring_on_this_rank(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dy: torch.Tensor,
    group: dist.ProcessGroup,
    dropout: float = 0.0,
    tile_elements: int | None = TILE_ELEMENTS,
    blocks: str = "auto",
    window: int | None = None,
) -> list[torch.Tensor]:
    """This rank's part of the whole-sequence q, k, v, dy through ring_attention (its blocks
    as ``blocks`` says; a sliding ``window``, if any): y, dq, dk, dv (this rank's parts).
    ``tile_elements`` None: all_to_all_attention instead."""
    cp, r = group.size(), group.rank()
    mine = [split_for_cp(t, 2, cp, r).requires_grad_() for t in (q, k, v)]
    if tile_elements is None:
        y = all_to_all_attention(*mine, group, dropout, window)
    else:
        y = ring_attention(*mine, group, dropout, tile_elements, blocks, window)
    y.backward(split_for_cp(dy, 2, cp, r))
    return [y.detach(), *(t.grad for t in mine)]


def drawn_and_wanted(
    case: dict, cp: int, r: int
) -> tuple[list[torch.Tensor], int | None, list[torch.Tensor]]:
    """The case's whole-sequence q, k, v, dy (draw), its ``window`` and rank ``r``'s part of
    the float64 reference's output and gradients."""
    drawn, window = draw(case, cp), case.get("window")
    return drawn, window, [split_for_cp(t, 2, cp, r) for t in reference(*drawn, window)]


def against_reference(cases: list[dict]) -> float:
    """On every rank of one cp group (the world): the largest absolute difference of the ring's
    output and gradients from the one-process reference's part of them, over ``cases`` (each
    with its ``blocks``, "flash" or "explicit" with its scores per tile, ``tile``, or the
    defaults; or with ``kind`` "a2a" the all-to-all exchange's; with ``window`` a sliding
    window)."""
    dist.init(timeout=60)
    group = dist.new_group(list(range(dist.get_world_size())))
    cp, r = group.size(), group.rank()
    worst = 0.0
    for case in cases:
        (q, k, v, dy), window, want = drawn_and_wanted(case, cp, r)
        tile = None if case.get("kind") == "a2a" else case.get("tile", TILE_ELEMENTS)
        blocks = case.get("blocks", "explicit" if "tile" in case else "auto")
        got = ring_on_this_rank(q, k, v, dy, group, 0.0, tile, blocks, window)
        worst = max(worst, *((a - w).abs().max().item() for a, w in zip(got, want, strict=True)))
    return worst


def relative_to_reference(
    cases: list[dict], group: dist.ProcessGroup, device: torch.device | None = None
) -> float:
    """On every rank of ``group``: the ring with the fused blocks ("flash"; with a ``window``
    the masked kernels) on inputs of each case's ``dtype`` (bf16 unless given) on ``device``,
    against the float64 reference: the largest difference of the output and each gradient
    from the reference's, over that reference's largest value."""
    cp, r = group.size(), group.rank()
    worst = 0.0
    for case in cases:
        drawn, window, want = drawn_and_wanted(case, cp, r)
        given = [t.to(device, case.get("dtype", torch.bfloat16)) for t in drawn]
        got = ring_on_this_rank(*given, group, 0.0, TILE_ELEMENTS, "flash", window)
        worst = max(worst, *(((a.double().cpu() - w).abs().max() / w.abs().max()).item()
                             for a, w in zip(got, want, strict=True)))  # fmt: skip
    return worst


def relative_on_cpu(cases: list[dict]) -> float:
    """relative_to_reference on this rank's CPU (cp = the world)."""
    dist.init(timeout=60)
    return relative_to_reference(cases, dist.new_group(list(range(dist.get_world_size()))))


def against_reference_on_gpu_0(case: dict) -> float:
    """relative_to_reference (bf16, or the case's ``dtype``; its ``window`` if any) on GPU 0
    over megart's nccl transport (tests/nccl_workers.py)."""
    import nccl_workers

    device = nccl_workers._init_on_gpu_0(timeout=120)
    group = dist.new_group(list(range(dist.get_world_size())))
    worst = relative_to_reference([case], group, device)
    dist.destroy()
    return worst


@contextlib.contextmanager
def counting() -> Iterator[dict]:
    """Every point-to-point op and collective this rank posts meanwhile: sends (peer, bytes),
    receives (peer), and the names of collectives called."""
    seen: dict = {"send": [], "recv": [], "collectives": []}
    real_batch = dist.batch_isend_irecv

    def batch(ops):
        for op in ops:
            kind = "send" if op.op is dist.isend else "recv"
            seen[kind].append((op.peer, op.tensor.numel() * op.tensor.element_size()))
        return real_batch(ops)

    patched = {"batch_isend_irecv": batch}
    for name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                 "reduce_scatter_single", "all_reduce", "broadcast"):  # fmt: skip
        real = getattr(dist, name)

        def collective(*a, _name=name, _real=real, **kw):
            seen["collectives"].append(_name)
            return _real(*a, **kw)

        patched[name] = collective
    saved = {name: getattr(dist, name) for name in patched}
    for name, fn in patched.items():
        setattr(dist, name, fn)
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def traffic(case: dict) -> dict:
    """What one ring attention's forward and backward send on this rank of the world group."""
    dist.init(timeout=60)
    group = dist.new_group(list(range(dist.get_world_size())))
    cp, r = group.size(), group.rank()
    q, k, v, dy = draw(case, cp)
    mine = [split_for_cp(t, 2, cp, r).requires_grad_() for t in (q, k, v)]
    with counting() as forward:
        y = ring_attention(*mine, group)
    with counting() as backward:
        y.backward(split_for_cp(dy, 2, cp, r))
    kv_bytes = 2 * mine[1].numel() * 8
    return {"forward": forward, "backward": backward, "kv_bytes": kv_bytes,
            "next": group.ranks[(r + 1) % cp], "prev": group.ranks[(r - 1) % cp]}  # fmt: skip


def aten_ops_called(case: dict, blocks: str) -> set[str]:
    """The aten operators one ring attention's forward and backward call on this rank (cp = the
    world), with ``blocks`` as ring_attention's (and the case's sliding ``window``, if any)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            called.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    dist.init(timeout=60)
    group = dist.new_group(list(range(dist.get_world_size())))
    q, k, v, dy = draw(case, group.size())
    called: set[str] = set()
    with Recording():
        ring_on_this_rank(q, k, v, dy, group, 0.0, TILE_ELEMENTS, blocks, case.get("window"))
    return called


def saved_by_attention(cfg_kw: dict, comm: str) -> list[tuple[int, ...]]:
    """The shapes of the tensors autograd saves for one Attention layer's forward at this
    rank (cp = the world), with ``comm`` as --cp-comm-type."""
    dist.init(timeout=60)
    group = dist.new_group(list(range(dist.get_world_size())))
    cfg = GPTConfig(**{**cfg_kw, "cp_comm_type": comm})
    layer = Attention(cfg, 0, None, False, cp_group=group).to(F64)
    local = cfg.seq_length // group.size()
    x = torch.randn(local, 2, cfg.hidden_size, dtype=F64, requires_grad=True)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    y.sum().backward()
    return shapes


def dropout_masks(
    case: dict, cp: int, r: int, dropout: float, window: int | None = None
) -> torch.Tensor:
    """The kept entries (scaled by 1 / (1 - p)) that ring attention with ``dropout`` draws on
    rank ``r`` from the current stream, as [b, heads, s/cp, s] over the keys' global positions:
    one torch.rand per step of the ring, over that step's block (block_of), in order; with a
    sliding ``window`` none for a block that no query's window reaches."""
    b, h, half = case["b"], case["heads"], case["half"]
    local, s = 2 * half, 2 * cp * half
    positions = [split_for_cp(torch.arange(s), 0, cp, j) for j in range(cp)]
    out = torch.zeros(b, h, local, s, dtype=F64)
    for step in range(cp):
        rows, keys, _ = block_of(step, cp, r, local)
        columns = positions[(r - step) % cp][keys]
        queries = positions[r][rows].unsqueeze(1)
        seen = (columns <= queries) & (columns >= queries - (s if window is None else window))
        if not seen.any():
            continue
        shape = (b, h, rows.stop - rows.start, keys.stop - keys.start)
        kept = (torch.rand(shape, dtype=F64) >= dropout).to(F64) / (1 - dropout)
        out[:, :, rows.start : rows.stop, columns] = kept
    return out


def against_reference_with_dropout(case: dict, dropout: float, window: int | None = None) -> float:
    """On every rank of the world group: ring attention with ``dropout`` against one process's
    float64 attention given the same kept entries (dropout_masks, drawn from the same seed)
    over the rank's queries, softmax o mask then x V; output and gradients (k's and v's summed
    over the ranks' queries; with a sliding ``window``, the explicit blocks' and the keys at most
    that many tokens back). The largest absolute difference; also that dropout dropped."""
    dist.init(timeout=60)
    group = dist.new_group(list(range(dist.get_world_size())))
    cp, r = group.size(), group.rank()
    q, k, v, dy = draw(case, cp)
    torch.manual_seed(11)
    got = ring_on_this_rank(q, k, v, dy, group, dropout, window=window)
    torch.manual_seed(11)
    keep = dropout_masks(case, cp, r, dropout, window)
    assert (keep == 0).any()
    per_group = q.shape[1] // k.shape[1]
    mine = split_for_cp(q, 2, cp, r).requires_grad_()
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    scores = mine @ kk.repeat_interleave(per_group, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    mine_at, keys_at = (
        split_for_cp(torch.arange(q.shape[2]), 0, cp, r).unsqueeze(1),
        torch.arange(q.shape[2]),
    )
    later = mine_at < keys_at
    if window is not None:
        later |= keys_at < mine_at - window
    p = torch.softmax(scores.masked_fill(later, float("-inf")), dim=-1)
    y = (p * keep) @ vv.repeat_interleave(per_group, 1)
    y.backward(split_for_cp(dy, 2, cp, r))
    for t in (kk.grad, vv.grad):
        dist.all_reduce(t, group=group)
    want = [y.detach(), mine.grad, *(split_for_cp(t.grad, 2, cp, r) for t in (kk, vv))]
    return max((a - w).abs().max().item() for a, w in zip(got, want, strict=True))


def scored_steps(case: dict, window: int | None) -> list[int]:
    """On every rank of the world group: the ring's forward and backward with the explicit
    blocks and a sliding ``window``; the number of tiles whose scores were computed (one tile
    per block: no block is split)."""
    import megart.models.ring_attention as ra

    dist.init(timeout=60)
    group = dist.new_group(list(range(dist.get_world_size())))
    q, k, v, dy = draw(case, group.size())
    calls = []
    real = ra._scores

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    ra._scores = counting
    try:
        ring_on_this_rank(q, k, v, dy, group, 0.0, TILE_ELEMENTS, "explicit", window)
    finally:
        ra._scores = real
    return len(calls)
