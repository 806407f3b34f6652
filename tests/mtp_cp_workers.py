"""Multi-token prediction and multi-latent attention under context parallelism, on every rank
of a launched test (module level, so spawn can import them): a whole one-chunk GPT at cp2 and
cp4 (and tp2 x cp2 with sequence parallelism) against one process, float64."""

from __future__ import annotations

import torch

import megart.distributed as dist
import megatron_core_workers as mcw
from cp_workers import _rel, _whole, cp2_and_cp4_groups
from megart.models import mtp_sequence
from megart.models.config import GPTConfig
from megart.models.context_parallel import split_for_cp
from megart.models.documents import Documents, document_positions
from megart.models.gpt import GPTChunk
from megart.tensor_parallel import sync_sequence_parallel_grads
from megart.tensor_parallel._group import group_rank, group_size

F64 = torch.float64


def run(
    cfg: GPTConfig,
    group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None = None,
    draw: bool = True,
    reset_positions: bool = False,
) -> dict:
    """A GPTChunk of ``cfg`` (weights with noise where ``draw``) on this rank's part of seeded
    token sequences with a loss mask (about a third of the positions out) for the depths:
    this rank's logits, main and depths' ([(1 + D) s/cp, b, V]; None with ``tp_group``);
    the depth losses and weight gradients averaged over the context-parallel group (as the
    trainer averages over dp x cp); the training loss the main tokens' mean. With
    ``reset_positions`` the positions restart after each of a frequent token (as
    --reset-position-ids after each EOD): the depths shift them along the whole sequence."""
    cp, r = group_size(group), group_rank(group)
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    mask = (torch.rand(2, cfg.seq_length, generator=g) > 0.3).to(F64)
    sp = tp_group is not None
    chunk = GPTChunk(cfg, range(cfg.num_layers), True, True, tp_group, sp, cp_group=group)
    chunk = chunk.to(F64)
    if draw:
        mcw.drawn(chunk)
    x, y, m = (split_for_cp(t, 1, cp, r) for t in (data[:, :-1], data[:, 1:], mask))
    documents = None
    if reset_positions:
        data[:, 3::5] = 7  # an end-of-document token every five
        x, y = (split_for_cp(t, 1, cp, r) for t in (data[:, :-1], data[:, 1:]))
        positions = document_positions(data[:, :-1], 7)
        documents = Documents(split_for_cp(positions, 1, cp, r), None)
    logits = chunk(x, documents)
    token_losses = chunk.token_losses(logits, y, m)
    token_losses.mean().backward()
    sync_sequence_parallel_grads(chunk, tp_group)
    tracked = chunk.aux_loss_scale.take().get("mtp", {})
    depths = torch.stack([tracked[k] for k in range(cfg.mtp_num_layers)]) if tracked else None
    grads = {n: _whole(p, tp_group) for n, p in chunk.named_parameters()}
    for n in {"wte.weight", "output_layer.weight"} & grads.keys():
        grads[n] = grads[n][: cfg.vocab_size]
    if group is not None:
        for t in (*grads.values(), *([] if depths is None else [depths])):
            dist.all_reduce(t, op="avg", group=group)
    logits = None if tp_group is not None else logits.detach()[..., : cfg.vocab_size]
    return {"logits": logits, "depths": depths, "grads": grads}


def _local_logits(want: torch.Tensor, parts: int, cp: int, r: int) -> torch.Tensor:
    """One process's logits [(1 + D) s, b, V] as cp rank ``r`` computes them: each part's
    (main, depth k) chunks of the sequence."""
    return torch.cat([split_for_cp(p, 0, cp, r) for p in want.chunk(parts)])


def plant(mistake: str) -> None:
    """A planted mistake in the depths' shifts under context parallelism: "local" shifts each
    rank's part as if it were the sequence (the shift within a rank's chunks, the count its
    own); "rank-order" shifts the ranks' parts put together in rank order, not the sequence's
    (the load-balanced split forgotten); "own-count" divides each rank's part by its own
    count, as Megatron-Core 0.16.1 does, not by the sequence's over cp; "no-scale" drops
    multi-latent attention's own softmax scale (YaRN's) under context parallelism."""
    parts = mtp_sequence.SequenceParts
    if mistake == "no-scale":
        import megart.models.mla as mla

        real_attention = mla.cp_attention
        mla.cp_attention = lambda *a: real_attention(*a[:-1], None)
    if mistake == "local":
        real = parts.__init__
        parts.__init__ = lambda self, group: real(self, None)
    elif mistake == "rank-order":

        def whole(self, x: torch.Tensor) -> torch.Tensor:
            if self.cp == 1:
                return x
            out = torch.empty((self.cp, *x.shape), dtype=x.dtype)
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
            return out.permute(1, 0, 2).reshape(x.shape[0], -1)

        parts.whole = whole
        parts.part = lambda self, x: x.chunk(self.cp, 1)[self.rank]
    elif mistake == "own-count":
        parts.count_share = lambda self, mask: self.part(mask).sum().clamp(min=1)


def against_one_process(models: dict[str, dict], comms: list[str], mistake: str = "") -> dict:
    """On each of 4 ranks: each of ``models`` (GPTConfig fields) at cp2 (ranks 0-1, 2-3) and
    cp4, for each --cp-comm-type of ``comms``, against one process; the largest relative
    differences of logits, depth losses and gradients by name. ``mistake``: see plant."""
    dist.init(timeout=120)
    plant(mistake)
    groups = cp2_and_cp4_groups()
    worst = {}
    for name, kw in models.items():
        kw = dict(kw)
        reset = kw.pop("reset_positions", False)
        want = run(GPTConfig(**kw), None, reset_positions=reset)
        parts = 1 + (kw.get("mtp_num_layers") or 0)
        for comm in comms:
            for size, grp in groups.items():
                got = run(GPTConfig(**kw, cp_comm_type=comm), grp, reset_positions=reset)
                key = f"{name} {comm} cp{size}"
                local = _local_logits(want["logits"], parts, size, group_rank(grp))
                worst[f"{key} logits"] = _rel(got["logits"], local)
                if want["depths"] is not None:
                    worst[f"{key} depths"] = _rel(got["depths"], want["depths"])
                worst[f"{key} grads"] = max(_rel(got["grads"][n], w)
                                            for n, w in want["grads"].items())  # fmt: skip
    return worst


def tp_sp_against_one_process(models: dict[str, dict], comm: str) -> dict:
    """On each of 4 ranks, tensor-parallel 2 (ranks 0-1, 2-3) x context-parallel 2 (ranks 0-2,
    1-3) with sequence parallelism: each of ``models`` (default weights) against one process;
    the largest relative differences of depth losses and gradients (gathered whole)."""
    dist.init(timeout=120)
    rank = dist.get_rank()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, cp = tp_groups[rank // 2], cp_groups[rank % 2]
    worst = {}
    for name, kw in models.items():
        want = run(GPTConfig(**kw), None, draw=False)
        got = run(GPTConfig(**kw, cp_comm_type=comm), cp, tp, draw=False)
        if want["depths"] is not None:
            worst[f"{name} depths"] = _rel(got["depths"], want["depths"])
        worst[f"{name} grads"] = max(_rel(got["grads"][n], w) for n, w in want["grads"].items())
    return worst


def latent_attention(comm: str, blocks: str = "auto", scale: float | None = 0.3) -> dict:
    """On each rank of a launched context-parallel group: attention of DeepSeek-shaped heads
    (queries and keys 12 wide, values 6: multi-latent attention's qk_head_dim + rope and
    v_head_dim), with a softmax ``scale`` of its own (YaRN's; None: 1/sqrt(12)), by the
    exchange ``comm`` (the ring's ``blocks`` "flash" or "explicit"), against torch's causal
    attention of the whole sequence in one process: the largest relative differences of the
    output and of dq, dk, dv."""
    import torch.nn.functional as F

    from megart.models.attention import cp_attention
    from megart.models.context_parallel import blockwise_attention, gather_kv
    from megart.models.ring_attention import ring_attention

    dist.init(timeout=60)
    group = dist.new_group(list(range(dist.get_world_size())))
    cp, r = group.size(), group.rank()
    g = torch.Generator().manual_seed(9)
    b, heads, s = 2, 4, 8 * cp
    q, k = (torch.randn(b, heads, s, 12, generator=g, dtype=F64) for _ in range(2))
    v, dy = (torch.randn(b, heads, s, 6, generator=g, dtype=F64) for _ in range(2))
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    y = F.scaled_dot_product_attention(*whole, is_causal=True, scale=scale)
    y.backward(dy)
    mine = [split_for_cp(x, 2, cp, r).requires_grad_() for x in (q, k, v)]
    if comm == "p2p":
        got = ring_attention(*mine, group, blocks=blocks, scale=scale)
    elif blocks == "blockwise":  # all_gather's GPU form (per query chunk, no mask tensor)
        kv = [gather_kv(x, group) for x in mine[1:]]
        got = blockwise_attention(mine[0], *kv, cp, r, 0.0, scale)
    else:
        got = cp_attention(*mine, group, comm, 0.0, scale)
    got.backward(split_for_cp(dy, 2, cp, r))
    out = {"y": _rel(got, split_for_cp(y, 2, cp, r))}
    for name, x, w in zip(("dq", "dk", "dv"), mine, whole, strict=True):
        out[name] = _rel(x.grad, split_for_cp(w.grad, 2, cp, r))
    return out


def train_with_mistake(kw: dict, mistake: str) -> list[dict]:
    """megart train's history (train_workers.train) with a mistake planted (see plant)."""
    import train_workers as tw

    plant(mistake)
    return tw.train(**kw)
