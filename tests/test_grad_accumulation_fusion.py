"""Gradient accumulation fusion (megart.tensor_parallel.weight_grad.fusing_accumulation, on in
`megart train` unless --no-gradient-accumulation-fusion): each microbatch's weight gradient is
added into the fp32 ``.grad`` by its product, accumulated in fp32, checked against float64; the
post-accumulate hooks the data-parallel buckets count run once per backward, as autograd's
own accumulation runs them; the input gradient is autocast's bit for bit; and `megart train`
gives the unfused run's gradients on every layout whose weight gradients it touches."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import train_workers as tw
from megart.launcher import launch
from megart.tensor_parallel import weight_grad
from megart.tensor_parallel.weight_grad import fusing_accumulation, linear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _layer(out_f: int, in_f: int, bias: bool, device: str = "cpu", buffer: bool = True):
    """A weight (and bias) with gradient buffers, as megart train's buckets give them, and a
    count of each parameter's post-accumulate hook calls."""
    g = torch.Generator().manual_seed(out_f * 131 + in_f)
    params = [torch.nn.Parameter(torch.randn(out_f, in_f, generator=g).to(device))]
    if bias:
        params.append(torch.nn.Parameter(torch.randn(out_f, generator=g).to(device)))
    calls = [0] * len(params)
    for i, p in enumerate(params):
        if buffer:
            p.grad = torch.zeros_like(p)
        p.register_post_accumulate_grad_hook(lambda _p, i=i: calls.__setitem__(i, calls[i] + 1))
    return params, calls


def _microbatches(k: int, rows: int, in_f: int, out_f: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(rows * 7 + k)
    return [
        (torch.randn(rows, in_f, generator=g).to(device), torch.randn(rows, out_f, generator=g))
        for _ in range(k)
    ]


def _run(params, batches, dtype, fused: bool, device: str = "cpu"):
    """Forward and backward of each microbatch (as the engine runs them, in one region);
    returns the input gradients."""
    weight, bias = params[0], (params[1] if len(params) > 1 else None)
    dxs = []
    autocast = dtype != torch.float32
    with torch.autocast(device, dtype=dtype, enabled=autocast), fusing_accumulation(fused):
        for x, dy in batches:
            x = x.clone().requires_grad_()
            y = linear(x, weight, bias)
            y.backward(dy.to(device=device, dtype=y.dtype))
            dxs.append(x.grad)
    return dxs


def _float64_sum(batches, dtype, device: str = "cpu"):
    """sum_k dY_k^T X_k and sum_k dY_k in float64, of the values the product sees."""
    dw = sum(dy.to(dtype).double().t() @ x.to(dtype).double().cpu() for x, dy in batches)
    db = sum(dy.to(dtype).double().sum(0) for _, dy in batches)
    return dw, db


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 24),
    in_f=st.integers(1, 40),
    out_f=st.integers(1, 24),
    k=st.integers(1, 3),
    bias=st.booleans(),
    dtype=st.sampled_from(sorted(DTYPES)),
)
def test_fused_gradients_are_the_float64_sum_of_the_microbatches_products(
    rows, in_f, out_f, k, bias, dtype
):
    dt = DTYPES[dtype]
    params, calls = _layer(out_f, in_f, bias)
    batches = _microbatches(k, rows, in_f, out_f)
    _run(params, batches, dt, fused=True)
    dw, db = _float64_sum(batches, dt)
    # Accumulated in fp32: a few fp32 roundings of each sum, never a 16-bit one.
    tol = dict(rtol=1e-5, atol=1e-5 * (1 + rows * k) ** 0.5)
    torch.testing.assert_close(params[0].grad.double(), dw, **tol)
    if bias:
        torch.testing.assert_close(params[1].grad.double(), db, **tol)
    assert calls == [k] * len(params)  # once per backward, as autograd's AccumulateGrad


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_input_gradients_are_autocasts_bit_for_bit(dtype):
    dt = DTYPES[dtype]
    batches = _microbatches(3, 16, 48, 32)
    fused_params, _ = _layer(32, 48, True)
    plain_params, _ = _layer(32, 48, True)
    fused = _run(fused_params, batches, dt, fused=True)
    plain = _run(plain_params, batches, dt, fused=False)
    for a, b in zip(fused, plain, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_check_catches_16_bit_rounding_of_each_microbatchs_product():
    # What the fusion exists to remove: without it, each bf16 product is rounded to bf16 before
    # it is added. The float64 check of the fused test above fails that path here.
    batches = _microbatches(4, 64, 256, 32)
    params, calls = _layer(32, 256, False)
    _run(params, batches, torch.bfloat16, fused=False)
    dw, _ = _float64_sum(batches, torch.bfloat16)
    assert calls == [4]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(params[0].grad.double(), dw, rtol=1e-5, atol=1e-5 * 257**0.5)


def test_a_parameter_without_a_gradient_is_left_to_autograd():
    params, calls = _layer(8, 12, True, buffer=False)
    batches = _microbatches(2, 5, 12, 8)
    _run(params, batches, torch.float32, fused=True)
    dw, db = _float64_sum(batches, torch.float32)
    torch.testing.assert_close(params[0].grad.double(), dw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(params[1].grad.double(), db, rtol=1e-5, atol=1e-5)
    assert calls == [2, 2]


def test_weights_are_cast_once_per_region_and_again_when_they_change():
    (weight,), _ = _layer(16, 16, False)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), fusing_accumulation():
        linear(x, weight).sum().backward()
        first = weight_grad._cast(weight, torch.bfloat16)
        linear(x, weight).sum().backward()
        assert weight_grad._cast(weight, torch.bfloat16) is first  # reused, not recast
        with torch.no_grad():
            weight.mul_(2)  # bumps the version: an optimizer step would
        second = weight_grad._cast(weight, torch.bfloat16)
        assert second is not first and torch.equal(second, (weight * 1).detach().bfloat16())
    assert weight_grad._fusion is None  # the region's casts are gone with it


def _tied_run(run_hooks: bool, dtype, k: int = 3, store=None):
    """A GPT's two uses of one weight in one backward: the embedding lookup (autograd's
    accumulation) and the tied output layer's product (fused), k microbatches under autocast.
    Returns the gradient, the hook count and the float64 gradient of the same values."""
    g = torch.Generator().manual_seed(5)
    vocab, h, rows = 24, 16, 10
    wte = torch.nn.Parameter(torch.randn(vocab, h, generator=g))
    wte.grad = torch.zeros_like(wte)
    calls = [0]
    wte.register_post_accumulate_grad_hook(lambda _p: calls.__setitem__(0, calls[0] + 1))
    batches = [
        (torch.randint(vocab, (rows,), generator=g), torch.randn(rows, vocab, generator=g))
        for _ in range(k)
    ]
    regions = [torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)]
    regions += [fusing_accumulation(True)] + ([weight_grad.deferring(store)] if store else [])
    with contextlib.ExitStack() as stack:
        for region in regions:
            stack.enter_context(region)
        for tokens, dy in batches:
            with store.input_grad("mb") if store else contextlib.nullcontext():
                x = torch.nn.functional.embedding(tokens, wte).tanh()
                y = linear(x, wte, defer=False, run_hooks=run_hooks)
                y.backward(dy.to(y.dtype))
    # The reference: the lookup's part as autograd gives it with the product's weight detached
    # (the same input gradients, autocast's, bit for bit), plus the float64 sum of the
    # product's dY^T X over the values the product sees.
    other = wte.detach().clone().requires_grad_()
    product = torch.zeros(vocab, h, dtype=torch.float64)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        for tokens, dy in batches:
            x = torch.nn.functional.embedding(tokens, other).tanh()
            y = torch.nn.functional.linear(x, other.detach())
            y.backward(dy.to(y.dtype))
            product += dy.to(dtype).double().t() @ x.detach().to(dtype).double()
    return wte.grad, calls[0], other.grad.double() + product


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_tied_weight_gets_both_uses_and_its_hooks_once_per_backward(dtype):
    grad, calls, ref = _tied_run(run_hooks=False, dtype=DTYPES[dtype])
    torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-5)
    assert calls == 3  # the lookup's accumulation runs them, after the product has added
    # What run_hooks=False exists for: the fused product running them too counts each
    # backward twice, which the data-parallel buckets would take for two microbatches.
    assert _tied_run(run_hooks=True, dtype=DTYPES[dtype])[1] == 6


def test_a_tied_product_is_not_left_to_a_zero_bubble_w():
    store = weight_grad.WeightGradStore()
    grad, calls, ref = _tied_run(run_hooks=False, dtype=torch.float32, k=2, store=store)
    assert store.pending("mb") == 0 and calls == 2
    torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs defer=False"):
        linear(torch.ones(1, 2), torch.nn.Parameter(torch.ones(2, 2)), run_hooks=False)


# megart train, fused (its default) against --no-gradient-accumulation-fusion, fp32: the same
# gradients on layouts where the hooks drive the data-parallel buckets (overlapped all-reduce,
# the distributed optimizer's reduce-scatter), where zero-bubble's W adds them, with tensor and
# sequence parallelism, and under bf16 within bf16's rounding.
LAYOUTS = {
    "dp2": (2, {}),
    "dp2-distopt": (2, dict(use_distributed_optimizer=True)),
    "pp2-zb-v": (2, dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-v")),
    # The last stage's copy of the tied embedding: its only use is the output layer, whose
    # fused product runs the hooks that drive that stage's buckets.
    "pp2-dp2": (4, dict(pipeline_model_parallel_size=2)),
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
}


def _grads(kw):
    return tw.gradients_after_one_step(**kw)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megart_train_gives_the_unfused_gradients(name):
    nproc, kw = LAYOUTS[name]
    fused = launch(_grads, nproc, kw, timeout=300)
    plain = launch(_grads, nproc, dict(kw, gradient_accumulation_fusion=False), timeout=300)
    for a, b in zip(fused, plain, strict=True):
        assert set(a) == set(b)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7, msg=key)


def test_megart_train_bf16_fused_is_nearer_fp32_than_unfused():
    # bf16 compute: the fused run's gradients keep the fp32 sum of each microbatch's product.
    fp32 = launch(_grads, 1, {}, timeout=300)[0]
    fused = launch(_grads, 1, dict(bf16=True), timeout=300)[0]
    plain = launch(_grads, 1, dict(bf16=True, gradient_accumulation_fusion=False), timeout=300)[0]

    def error(run):
        return sum((run[k] - fp32[k]).double().norm() ** 2 for k in fp32) ** 0.5

    assert error(fused) < error(plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_product_accumulates_in_fp32(dtype):
    # The CUDA path: one addmm with 16-bit inputs writing fp32 into the gradient itself.
    batches = _microbatches(3, 512, 1024, 256, device="cuda")
    params, calls = _layer(256, 1024, True, device="cuda")
    _run(params, batches, dtype, fused=True, device="cuda")
    dw, db = _float64_sum(batches, dtype, device="cuda")
    torch.testing.assert_close(params[0].grad.double().cpu(), dw.cpu(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(params[1].grad.double().cpu(), db.cpu(), rtol=1e-5, atol=1e-3)
    assert calls == [3, 3]


def test_selftest_check_passes_and_fails_a_fusion_that_rounds_to_16_bits(monkeypatch):
    # `megart selftest` checks the fusion on the user's device; here its CPU run, then the same
    # check against a fusion that rounds each 16-bit product before adding it.
    from megart.selftest import components

    cpu = torch.device("cpu")
    assert all(c.status == "pass" for c in components.check_grad_accumulation_fusion(cpu))

    def rounding(grad, dy2, x2):
        grad.add_(dy2.t().mm(x2.to(dy2.dtype)))

    monkeypatch.setattr(weight_grad, "_add_product", rounding)
    checks = components.check_grad_accumulation_fusion(cpu)
    assert [c.status for c in checks] == ["pass", "fail", "fail"]  # fp32, bf16, fp16
    assert all("--no-gradient-accumulation-fusion" in c.detail for c in checks[1:])
