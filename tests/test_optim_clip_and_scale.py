"""Gradient clipping, multi-tensor helpers and the fp16 loss scaler."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megart
from megart import _core
from megart.optim import AdamW, LossScaler, clip_grad_norm_, grad_sum_of_squares
from megart.optim.clip import scale_grads_
from optim_helpers import clone_params, make_params, set_grads


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e6])
def test_clip_grad_norm_matches_torch(max_norm):
    ours = make_params(seed=1)
    theirs = clone_params(ours)
    set_grads([ours, theirs], seed=9)
    norm = clip_grad_norm_(ours, max_norm)
    ref = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm.dtype == ref.dtype
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_clip_grad_norm_reduce_fn_sees_local_sum_of_squares():
    ours = make_params(seed=2)
    set_grads([ours], seed=3)
    local = sum(float((p.grad.double() ** 2).sum()) for p in ours)
    seen = []

    def reduce_fn(t):  # as if a second rank held an identical shard
        seen.append(float(t))
        return t * 2

    norm = clip_grad_norm_(ours, 1e9, reduce_fn=reduce_fn)
    assert seen[0] == pytest.approx(local, rel=1e-12)
    assert float(norm) == pytest.approx((2 * local) ** 0.5, rel=1e-6)


def test_clip_grad_norm_errors():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    with pytest.raises(megart.MegartError, match="non-finite"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    with pytest.raises(megart.ConfigError, match="norm_type"):
        clip_grad_norm_([p], 1.0, norm_type=1.0)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50_000), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    threads=st.integers(1, 3),
)
def test_sum_of_squares_and_scale_match_torch(sizes, dtype, threads):
    gen = torch.Generator().manual_seed(sum(sizes))
    tensors = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    expected = sum(float((t.double() ** 2).sum()) for t in tensors)
    got = float(grad_sum_of_squares(tensors, num_threads=threads))
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)
    ptrs = [t.data_ptr() for t in tensors]
    scaled = [(t.float() * 0.37).to(dtype) for t in tensors]
    name = str(dtype).removeprefix("torch.")
    found = _core.optim.scale(ptrs, ptrs, [t.numel() for t in tensors], name, 0.37, threads)
    assert found is False
    for t, s in zip(tensors, scaled, strict=True):
        assert torch.equal(t, s)


def test_scale_flags_inf_and_nan_and_copies_out_of_place():
    a = torch.ones(100_000)
    b = torch.ones(9)
    out_a, out_b = torch.empty_like(a), torch.empty_like(b)
    args = ([a.data_ptr(), b.data_ptr()], [out_a.data_ptr(), out_b.data_ptr()], [100_000, 9])
    assert _core.optim.scale(*args, "float32", 2.0) is False
    assert torch.all(out_a == 2.0) and torch.all(out_b == 2.0)
    b[4] = float("nan")
    assert _core.optim.scale(*args, "float32", 2.0) is True
    b[4] = 0.0
    a[99_999] = float("-inf")
    assert _core.optim.scale(*args, "float32", 2.0) is True


def test_loss_scaler_skips_step_on_overflow_and_lowers_scale():
    params = make_params(seed=4)
    before = [p.detach().clone() for p in params]
    opt = AdamW(params, lr=1e-2)
    scaler = LossScaler(init_scale=1024.0, growth_interval=2)
    # Megatron's default hysteresis, 2: the first overflow skips its step and keeps the scale,
    # the second skips its step and halves it.
    for scale in (1024.0, 512.0):
        set_grads([params], seed=0)
        params[2].grad[5] = float("inf")
        assert scaler.step(opt) is False
        assert scaler.scale == scale
        for p, b in zip(params, before, strict=True):
            assert torch.equal(p.detach(), b)
            assert p not in opt.state or opt.state[p]["step"].item() == 0.0

    # Two clean steps: both taken (gradients unscaled first), then the scale grows.
    ref_params = clone_params(params)
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    for step in range(2):
        set_grads([params, ref_params], seed=10 + step)
        for p in params:
            p.grad.mul_(scaler.scale)
        assert scaler.step(opt) is True
        ref.step()
    assert scaler.scale == 1024.0
    for p, r in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_found_inf_flag_skips_adam_step_on_cpu():
    params = make_params(seed=5)
    before = [p.detach().clone() for p in params]
    opt = AdamW(params)
    set_grads([params], seed=1)
    opt.step(found_inf=torch.ones(1, dtype=torch.int32))
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    opt.step(found_inf=torch.zeros(1, dtype=torch.int32))
    assert not torch.equal(params[2].detach(), before[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_scale_grads_is_bitwise_torch_mul_for_contiguous_and_strided_grads(dtype, as_tensor):
    """The one gradient-scaling helper (clip_grad_norm_ passes a tensor, the Trainer a float):
    contiguous grads take megart's sweep, strided ones torch's foreach; both must equal
    torch's own g.mul_(coef)."""
    gen = torch.Generator().manual_seed(11)
    grads = [
        torch.randn(1000, generator=gen).to(dtype),
        torch.randn(7, 9, generator=gen).to(dtype).t(),  # strided
        torch.randn(1, generator=gen).to(dtype),
    ]
    coef = 0.3719
    expected = [g.clone().mul_(torch.tensor(coef) if as_tensor else coef) for g in grads]
    scale_grads_(grads, torch.tensor(coef) if as_tensor else coef, num_threads=2)
    for g, e in zip(grads, expected, strict=True):
        assert torch.equal(g, e)


def test_scale_path_sends_16_bit_cuda_grads_to_the_multi_tensor_kernel():
    # The dispatch alone (no GPU here): fp16 and bf16 gradients on CUDA take the kernel like
    # fp32 ones, not torch's per-tensor ops; CPU and everything the kernels cannot take as before.
    from megart.optim.loss_scale import scale_path

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert scale_path("cuda", dtype, True, True) == "cuda"
        assert scale_path("cuda", dtype, False, True) == "torch"  # strided
        assert scale_path("cuda", dtype, True, False) == "torch"  # built without CUDA kernels
        assert scale_path("cpu", dtype, True, False) == "core"
        assert scale_path("cpu", dtype, False, False) == "torch"
    assert scale_path("cuda", torch.float64, True, True) == "torch"
    assert scale_path("cpu", torch.float64, True, False) == "torch"
    assert scale_path("meta", torch.float32, True, True) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_unscale_on_cpu_is_unchanged_for_every_dtype(dtype):
    # CPU behaviour stays bitwise torch's (the C++ sweep, or torch for float64).
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (1, 9, 70000)]
    for i, p in enumerate(params):
        p.grad = (torch.randn(p.numel(), generator=torch.Generator().manual_seed(i)) * 100).to(
            dtype
        )
    expected = [p.grad * (1.0 / 64.0) for p in params]
    assert LossScaler(init_scale=64.0).unscale_(params).item() == 0
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=0)
    params[2].grad[5] = float("nan")
    assert LossScaler(init_scale=64.0).unscale_(params).item() == 1
