"""Tensor-parallel checks that run on every rank of a launched test (module level, so spawn can
import them). One launch of 4 ranks covers tensor-parallel sizes 1, 2 and 4 (groups of
adjacent ranks) and the no-group case (None), so each launch checks many cases.

Every rank builds the same full inputs from a seed, runs the parallel module on its share, and
compares its share of the outputs and gradients with a single-process torch reference in
float64. Weight gradients are compared shard by shard: every rank checks its own, which
together is the gathered weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import megart.distributed as dist
import megart.tensor_parallel as tp
from megart.distributed import ProcessGroup

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def tp_groups() -> list[ProcessGroup | None]:
    """None, then this rank's group of each size 1, 2, 4 that divides the world. Every process
    makes the same groups in the same order, as new_group requires."""
    dist.init(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine: list[ProcessGroup | None] = [None]
    for size in (1, 2, 4):
        if world % size:
            continue
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if rank in group.ranks:
                mine.append(group)
    return mine


def size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size(), group.rank())


def mine(x: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim``."""
    t, r = size_rank(group)
    return x.chunk(t, dim)[r]


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


# ---------------------------------------------------------------------------------------------
# Mappings


def _mappings_in(group: ProcessGroup | None, seed: int) -> int:
    t, r = size_rank(group)
    gen = torch.Generator().manual_seed(seed)
    s, b, h = 2 * t, 3 * t, 4 * t
    xs = [randn(gen, s, b, h) for _ in range(t)]  # every rank's input, known to all
    gs = [randn(gen, s, b, h) for _ in range(t)]  # every rank's incoming gradient
    total_x, total_g = sum(xs), sum(gs)
    checks = 0

    def run(fn, x, expect_y, expect_grad, what):
        nonlocal checks
        x = x.clone().requires_grad_()
        y = fn(x)
        close(y, expect_y, f"{what} forward")
        y.backward(gs[r])
        close(x.grad, expect_grad, f"{what} backward")
        checks += 1

    run(lambda x: tp.copy_to_region(x, group), xs[r], xs[r], total_g, "copy_to_region")
    run(lambda x: tp.reduce_from_region(x, group), xs[r], total_x, gs[r], "reduce_from_region")

    # Split then gather along the last dim, with the gradient each rank feeds in.
    x = xs[r]
    xr = x.clone().requires_grad_()
    y = tp.scatter_to_region(xr, group)
    close(y, mine(x, group, -1), "scatter_to_region forward")
    g_slices = [gs[q].chunk(t, -1)[q] for q in range(t)]
    y.backward(g_slices[r])
    close(xr.grad, torch.cat(g_slices, -1), "scatter_to_region backward")

    xr = mine(x, group, -1).clone().requires_grad_()
    y = tp.gather_from_region(xr, group)
    parts = [xs[q].chunk(t, -1)[q] for q in range(t)]
    close(y, torch.cat(parts, -1), "gather_from_region forward")
    y.backward(gs[r])
    close(xr.grad, mine(gs[r], group, -1), "gather_from_region backward")
    checks += 2

    # The sequence-parallel trio, along dim 0 (Megatron's [s, b, h]) and along dim 1.
    for dim in (0, 1):
        n = xs[r].shape[dim] // t
        own = [x.narrow(dim, q * n, n) for q, x in enumerate(xs)]  # rank q's slice of x_q

        xr = xs[r].clone().requires_grad_()
        y = tp.scatter_to_sequence_region(xr, group, dim=dim)
        close(y, own[r], f"scatter_to_sequence_region({dim}) forward")
        g_own = [g.narrow(dim, q * n, n) for q, g in enumerate(gs)]
        y.backward(g_own[r])
        close(xr.grad, torch.cat(g_own, dim), f"scatter_to_sequence_region({dim}) backward")

        for reduce_grad in (True, False):
            xr = own[r].clone().requires_grad_()
            y = tp.gather_from_sequence_region(xr, group, dim=dim, reduce_grad=reduce_grad)
            close(y, torch.cat(own, dim), f"gather_from_sequence_region({dim}) forward")
            y.backward(gs[r])
            expect = total_g if reduce_grad else gs[r]
            close(
                xr.grad,
                expect.narrow(dim, r * n, n),
                f"gather_from_sequence_region({dim}, {reduce_grad}) backward",
            )

        xr = xs[r].clone().requires_grad_()
        y = tp.reduce_scatter_to_sequence_region(xr, group, dim=dim)
        close(y, total_x.narrow(dim, r * n, n), f"reduce_scatter({dim}) forward")
        y.backward(g_own[r])
        close(xr.grad, torch.cat(g_own, dim), f"reduce_scatter({dim}) backward")
        checks += 4

    # A non-contiguous input (a transpose) communicates the same values as a contiguous one.
    xt = xs[r].transpose(0, 2)
    y = tp.reduce_from_region(xt, group)
    close(y, total_x.transpose(0, 2), "reduce_from_region of a transpose")
    y = tp.gather_from_sequence_region(xt, group, dim=2)
    close(y, torch.cat(xs, 0).transpose(0, 2), "gather of a transpose")
    return checks + 2


def mappings(seed: int) -> int:
    return sum(_mappings_in(group, seed) for group in tp_groups())


# ---------------------------------------------------------------------------------------------
# Linear layers and the MLP block


def _full_linear(layer_cls: type, h_in: int, h_out: int, seed: int) -> nn.Linear:
    """nn.Linear holding the weights a tp=1 layer gets from ``seed``, and a random bias."""
    single = layer_cls(h_in, h_out, generator=torch.Generator().manual_seed(seed), dtype=F64)
    ref = nn.Linear(h_in, h_out, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(single.weight)
        ref.bias.copy_(randn(torch.Generator().manual_seed(seed + 1), h_out))
    return ref


def _column(group, case, sp: bool, gather: bool) -> None:
    s, b, h_in, h_out, seed = case
    gen = torch.Generator().manual_seed(seed)
    x, gy = randn(gen, s, b, h_in), randn(gen, s, b, h_out)
    ref = _full_linear(tp.ColumnParallelLinear, h_in, h_out, seed)
    layer = tp.ColumnParallelLinear(
        h_in,
        h_out,
        gather_output=gather,
        sequence_parallel=sp,
        tp_group=group,
        generator=torch.Generator().manual_seed(seed),
        dtype=F64,
    )
    # Layout-independent initialisation: this shard is exactly a slice of the tp=1 weight.
    assert torch.equal(layer.weight, mine(ref.weight, group, 0)), "column init"
    with torch.no_grad():
        layer.bias.copy_(mine(ref.bias, group, 0))

    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * gy).sum().backward()

    x_in = (mine(x, group, 0) if sp else x).clone().requires_grad_()
    y = layer(x_in)
    expect = y_ref if gather else mine(y_ref, group, -1)
    what = f"column sp={sp} gather={gather} {case}"
    close(y, expect, f"{what} output")
    (y * (gy if gather else mine(gy, group, -1))).sum().backward()
    close(x_in.grad, mine(x_ref.grad, group, 0) if sp else x_ref.grad, f"{what} input grad")
    close(layer.weight.grad, mine(ref.weight.grad, group, 0), f"{what} weight grad")
    close(layer.bias.grad, mine(ref.bias.grad, group, 0), f"{what} bias grad")


def _row(group, case, sp: bool, input_is_parallel: bool) -> None:
    s, b, h_in, h_out, seed = case
    gen = torch.Generator().manual_seed(seed)
    x, gy = randn(gen, s, b, h_in), randn(gen, s, b, h_out)
    ref = _full_linear(tp.RowParallelLinear, h_in, h_out, seed)
    layer = tp.RowParallelLinear(
        h_in,
        h_out,
        input_is_parallel=input_is_parallel,
        sequence_parallel=sp,
        tp_group=group,
        generator=torch.Generator().manual_seed(seed),
        dtype=F64,
    )
    assert torch.equal(layer.weight, mine(ref.weight, group, 1)), "row init"
    with torch.no_grad():
        layer.bias.copy_(ref.bias)

    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * gy).sum().backward()

    x_in = (mine(x, group, -1) if input_is_parallel else x).clone().requires_grad_()
    y = layer(x_in)
    what = f"row sp={sp} input_is_parallel={input_is_parallel} {case}"
    close(y, mine(y_ref, group, 0) if sp else y_ref, f"{what} output")
    (y * (mine(gy, group, 0) if sp else gy)).sum().backward()
    tp.sync_sequence_parallel_grads(layer, group)
    close(
        x_in.grad,
        mine(x_ref.grad, group, -1) if input_is_parallel else x_ref.grad,
        f"{what} input grad",
    )
    close(layer.weight.grad, mine(ref.weight.grad, group, 1), f"{what} weight grad")
    close(layer.bias.grad, ref.bias.grad, f"{what} bias grad")


def _mlp(group, case, sp: bool) -> None:
    """Column (h -> f) then GELU then row (f -> h), Megatron's MLP block."""
    s, b, h, f, seed = case
    gen = torch.Generator().manual_seed(seed + 7)
    x, gy = randn(gen, s, b, h), randn(gen, s, b, h)
    ref1 = _full_linear(tp.ColumnParallelLinear, h, f, seed)
    ref2 = _full_linear(tp.RowParallelLinear, f, h, seed + 2)
    fc1 = tp.ColumnParallelLinear(
        h,
        f,
        sequence_parallel=sp,
        tp_group=group,
        generator=torch.Generator().manual_seed(seed),
        dtype=F64,
    )
    fc2 = tp.RowParallelLinear(
        f,
        h,
        sequence_parallel=sp,
        tp_group=group,
        generator=torch.Generator().manual_seed(seed + 2),
        dtype=F64,
    )
    with torch.no_grad():
        fc1.bias.copy_(mine(ref1.bias, group, 0))
        fc2.bias.copy_(ref2.bias)

    x_ref = x.clone().requires_grad_()
    y_ref = ref2(F.gelu(ref1(x_ref)))
    (y_ref * gy).sum().backward()

    x_in = (mine(x, group, 0) if sp else x).clone().requires_grad_()
    y = fc2(F.gelu(fc1(x_in)))
    what = f"mlp sp={sp} {case}"
    close(y, mine(y_ref, group, 0) if sp else y_ref, f"{what} output")
    (y * (mine(gy, group, 0) if sp else gy)).sum().backward()
    tp.sync_sequence_parallel_grads(fc2, group)
    close(x_in.grad, mine(x_ref.grad, group, 0) if sp else x_ref.grad, f"{what} input grad")
    close(fc1.weight.grad, mine(ref1.weight.grad, group, 0), f"{what} fc1 weight grad")
    close(fc1.bias.grad, mine(ref1.bias.grad, group, 0), f"{what} fc1 bias grad")
    close(fc2.weight.grad, mine(ref2.weight.grad, group, 1), f"{what} fc2 weight grad")
    close(fc2.bias.grad, ref2.bias.grad, f"{what} fc2 bias grad")


def _embedding(group, case, sp: bool) -> None:
    s, b, vocab, dim, seed = case
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (s, b), generator=gen)
    gy = randn(gen, s, b, dim)
    single = tp.VocabParallelEmbedding(
        vocab, dim, generator=torch.Generator().manual_seed(seed), dtype=F64
    )
    ref = nn.Embedding(vocab, dim, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(single.weight)
    layer = tp.VocabParallelEmbedding(
        vocab,
        dim,
        sequence_parallel=sp,
        tp_group=group,
        generator=torch.Generator().manual_seed(seed),
        dtype=F64,
    )
    assert torch.equal(layer.weight, mine(ref.weight, group, 0)), "embedding init"
    y_ref = ref(ids)
    (y_ref * gy).sum().backward()
    y = layer(ids)
    what = f"embedding sp={sp} {case}"
    close(y, mine(y_ref, group, 0) if sp else y_ref, f"{what} output")
    (y * (mine(gy, group, 0) if sp else gy)).sum().backward()
    close(layer.weight.grad, mine(ref.weight.grad, group, 0), f"{what} weight grad")


def layers(cases: list[tuple[int, int, int, int, int]]) -> int:
    """Each case (s, b, h_in, h_out, seed) through every layer, group and layout. ``s``,
    ``h_in`` and ``h_out`` are multiples of 4, so every group size divides them."""
    checks = 0
    for group in tp_groups():
        for case in cases:
            for sp in (False, True):
                for gather in (False,) if sp else (False, True):
                    _column(group, case, sp, gather)
                    checks += 1
                for input_is_parallel in (True,) if sp else (True, False):
                    _row(group, case, sp, input_is_parallel)
                    checks += 1
                _mlp(group, case, sp)
                _embedding(group, case, sp)
                checks += 2
    return checks


# ---------------------------------------------------------------------------------------------
# Cross-entropy


def cross_entropy(cases: list[tuple], fused: bool = False) -> int:
    """Each case (tokens, vocab, ignored tokens, logit scale, seed[, padded]); vocab a multiple
    of 4. ``padded`` sets the upper half of the vocabulary to -inf, as GPT's padded ids (at
    t = 2 the second rank then holds only -inf). ``fused``: megart.kernels' fused op."""
    from megart.kernels import fused_vocab_parallel_cross_entropy

    loss_fn = fused_vocab_parallel_cross_entropy if fused else tp.vocab_parallel_cross_entropy
    checks = 0
    for group in tp_groups():
        for n, vocab, n_ignored, scale, seed, *padded in cases:
            gen = torch.Generator().manual_seed(seed)
            logits = randn(gen, 2, n, vocab) * scale  # [b, s, V]: any leading shape works
            real = vocab // 2 if any(padded) else vocab
            logits[..., real:] = float("-inf")
            target = torch.randint(0, real, (2, n), generator=gen)
            target.view(-1)[:n_ignored] = -100
            g_loss = randn(gen, 2, n)

            full = logits.clone().requires_grad_()
            loss_ref = F.cross_entropy(
                full.reshape(-1, vocab), target.reshape(-1), reduction="none"
            ).view(2, n)
            (loss_ref * g_loss).sum().backward()

            local = mine(logits, group, -1).clone().requires_grad_()
            loss = loss_fn(local, target, group)
            what = f"cross-entropy {(n, vocab, n_ignored, scale, seed, *padded)} fused={fused}"
            close(loss, loss_ref, f"{what} loss")
            (loss * g_loss).sum().backward()
            close(local.grad, mine(full.grad, group, -1), f"{what} logits grad")
            checks += 1
    return checks
